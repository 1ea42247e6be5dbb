"""One name for the two TensorRT Python modules: ``tensorrt`` (10.x/11.x) and ``tensorrt_rtx`` (TensorRT for RTX).

Both expose the same builder/runtime API for what we use (Builder, STRONGLY_TYPED networks, OnnxParser,
optimisation profiles, build_serialized_network, Runtime, IExecutionContext.set_input_shape /
set_tensor_address / execute_async_v3). The differences we meet are handled where they occur:

- ``tensorrt_rtx`` ignores timing caches (a no-op since TensorRT-RTX 1.2), so ``--timing-cache`` is used
  with ``tensorrt`` only;
- ``tensorrt_rtx`` builds ahead of time without a GPU (kernels are compiled for the GPU at first run), so
  CI builds real engines with it; ``tensorrt`` needs a GPU to build;
- they run on different GPUs (``RUNS_ON``): TensorRT-RTX on RTX-class GPUs (compute capability 7.5-8.9 and
  12.x), not on data-centre Hopper/Blackwell (9.0, 10.x); ``tensorrt`` on 7.5 and newer. ``auto`` skips a
  library that cannot run on the GPU present, and ``TrtBackend`` checks an engine's library against the GPU
  when it opens the engine.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass
from types import ModuleType

from eagle_export.errors import EngineError

log = logging.getLogger(__name__)

#: CLI spelling -> module name (None: auto).
LIB_CHOICES = {"auto": None, "tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx", "tensorrt_rtx": "tensorrt_rtx"}
#: module -> supported major versions.
SUPPORTED_MAJORS = {"tensorrt": (10, 11), "tensorrt_rtx": (1,)}
#: module -> how to install it.
PIP_HINTS = {
    "tensorrt": "pip install tensorrt (10.x or 11.x; NVIDIA's wheels need a CUDA machine to build engines)",
    "tensorrt_rtx": "pip install 'eagle-export[engines]' (tensorrt-rtx-cu12==1.7.1.116, builds engines without a "
                    "GPU)",
}
AUTO_ORDER = ("tensorrt", "tensorrt_rtx")
#: module -> (what it runs on, in words; whether it runs on a compute capability).
RUNS_ON = {
    "tensorrt": ("compute capability 7.5 and newer", lambda cc: cc >= (7, 5)),
    "tensorrt_rtx": ("RTX-class GPUs, compute capability 7.5-8.9 and 12.x (not data-centre 9.0/10.x)",
                     lambda cc: (7, 5) <= cc <= (8, 9) or cc[0] == 12),
}


def cannot_run(name: str, capability: tuple[int, int]) -> str | None:
    """Why library ``name`` cannot run engines on a GPU of this compute capability, or None when it can."""
    words, runs = RUNS_ON[name]
    if runs(tuple(capability)):
        return None
    return f"{name} cannot run on compute capability {capability[0]}.{capability[1]}: it runs on {words}"


def gpu_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or None without a CUDA device (or a CUDA torch)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


@dataclass(frozen=True)
class TrtLib:
    name: str  # "tensorrt" or "tensorrt_rtx"
    module: ModuleType
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.name == "tensorrt_rtx"

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


def _major(version: str) -> int | None:
    m = re.match(r"(\d+)", version)
    return int(m.group(1)) if m else None


def _import(name: str) -> TrtLib:
    """Import one module; ImportError (or a broken install's OSError) becomes an EngineError naming the fix."""
    try:
        module = importlib.import_module(name)
    except (ImportError, OSError) as e:
        raise EngineError(f"cannot import {name} ({type(e).__name__}: {e}): {PIP_HINTS[name]}") from None
    version = str(getattr(module, "__version__", "unknown"))
    major = _major(version)
    if major not in SUPPORTED_MAJORS[name]:
        wanted = " or ".join(f"{m}.x" for m in SUPPORTED_MAJORS[name])
        raise EngineError(f"{name} {version} is not supported: eagle-export needs {name} {wanted}")
    return TrtLib(name, module, version)


def module_name(choice: str) -> str | None:
    if choice not in LIB_CHOICES:
        shown = ", ".join(k for k in LIB_CHOICES if "_" not in k)
        raise EngineError(f"engine library {choice!r} is not one of: {shown}")
    return LIB_CHOICES[choice]


def load_lib(choice: str = "auto", capability: tuple[int, int] | None = None) -> TrtLib:
    """``auto``: ``tensorrt`` when it imports (and is a supported version), else ``tensorrt_rtx``; with a GPU of
    compute ``capability`` present (default: the current CUDA device's, None without one), only a library that
    can run engines on it."""
    name = module_name(choice)
    if name is not None:
        return _import(name)
    if capability is None:
        capability = gpu_capability()
    problems = []
    for candidate in AUTO_ORDER:
        why = cannot_run(candidate, capability) if capability is not None else None
        if why is not None:
            problems.append(why)
            continue
        try:
            return _import(candidate)
        except EngineError as e:
            problems.append(str(e))
    raise EngineError("no TensorRT Python module is usable: " + "; ".join(problems))


def make_logger(lib: TrtLib):
    trt = lib.module

    class _Logger(trt.ILogger):
        """Keeps TensorRT's messages for error reports; warnings go to Python logging at debug level."""

        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.warnings: list[str] = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(msg)
            elif severity == trt.ILogger.Severity.WARNING:
                self.warnings.append(msg)
                log.debug("TensorRT: %s", msg)

        def reset(self):
            self.errors.clear()
            self.warnings.clear()

    return _Logger()
