"""One name for the two TensorRT Python modules: ``tensorrt`` (10.1+/11.x) and ``tensorrt_rtx`` (TensorRT for RTX).

Both expose the same builder/runtime API for what we use (Builder, STRONGLY_TYPED networks, OnnxParser,
optimisation profiles, build_serialized_network, Runtime, IExecutionContext.set_input_shape /
set_tensor_address / execute_async_v3). The differences we meet are handled where they occur:

- ``tensorrt_rtx`` ignores timing caches (a no-op since TensorRT-RTX 1.2), so ``--timing-cache`` is used
  with ``tensorrt`` only;
- ``tensorrt_rtx`` builds ahead of time without a GPU (kernels are compiled for the GPU at first run), for the
  compute capabilities the builder names (``RTX_BUILD_FOR``, recorded in the manifest), so CI builds real engines
  with it; ``tensorrt`` needs a GPU to build (on a machine without one its ``Builder()`` raises ``TypeError``);
- they run on different GPUs (``RUNS_ON``): TensorRT-RTX on RTX-class GPUs (compute capability 7.5-8.9 and
  12.x), not on data-centre Hopper/Blackwell (9.0, 10.x); ``tensorrt`` on 7.5 and newer. ``auto`` skips a
  library that cannot run on the GPU present, prefers ``tensorrt_rtx`` when there is no GPU (it is the one that
  can build there), and ``TrtBackend`` checks an engine's library against the GPU when it opens the engine.

The supported versions are written once, here (``SUPPORTED``): pyproject.toml's extras spell the same bounds
(``tests/test_install_extras.py`` checks that they agree).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from eagle_export.errors import EngineError

log = logging.getLogger(__name__)

#: CLI spelling -> module name (None: auto).
LIB_CHOICES = {"auto": None, "tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx", "tensorrt_rtx": "tensorrt_rtx"}
#: module -> the versions eagle-export supports (a PEP 440 specifier; pyproject.toml's extras use the same).
#: tensorrt 10.0 lacks ICudaEngine.get_device_memory_size_for_profile_v2 and IExecutionContext.set_device_memory
#: (memory, size), both new in 10.1, which the backend's shared context memory needs.
SUPPORTED = {"tensorrt": ">=10.1,<12", "tensorrt_rtx": ">=1.0,<2"}
#: pyproject.toml extra -> (distribution it installs, module). The tensorrt meta package installs NVIDIA's CUDA 13
#: wheels (tensorrt-cu13, from 10.13.2); tensorrt-cu12 the CUDA 12 ones.
EXTRAS = {"tensorrt": ("tensorrt", "tensorrt"), "tensorrt-cu12": ("tensorrt-cu12", "tensorrt"),
          "tensorrt-rtx": ("tensorrt-rtx-cu12", "tensorrt_rtx")}
#: module -> how to install it.
PIP_HINTS = {
    "tensorrt": "pip install 'eagle-export[tensorrt]' (CUDA 13 driver; 'eagle-export[tensorrt-cu12]' for a CUDA 12 "
                "driver): TensorRT " + SUPPORTED["tensorrt"] + ", needs a CUDA GPU to build engines",
    "tensorrt_rtx": "pip install 'eagle-export[tensorrt-rtx]' (TensorRT for RTX, builds engines without a GPU)",
}
#: What a CUDA build of ONNX Runtime needs: the CPU wheel out first (both ship the module ``onnxruntime``, so
#: installing one over the other leaves a mix of their files), then the GPU wheel with NVIDIA's CUDA libraries.
ORT_GPU_VERSION = "1.31.1"
ORT_GPU_INSTALL = (f'pip uninstall -y onnxruntime onnxruntime-gpu && pip install "onnxruntime-gpu[cuda,cudnn]=='
                   f'{ORT_GPU_VERSION}"')
AUTO_ORDER = ("tensorrt", "tensorrt_rtx")  # with a GPU
AUTO_ORDER_NO_GPU = ("tensorrt_rtx", "tensorrt")  # without one only TensorRT-RTX can build
#: module -> (what it runs on, in words; whether it runs on a compute capability).
RUNS_ON = {
    "tensorrt": ("compute capability 7.5 and newer", lambda cc: cc >= (7, 5)),
    "tensorrt_rtx": ("RTX-class GPUs, compute capability 7.5-8.9 and 12.x (not data-centre 9.0/10.x)",
                     lambda cc: (7, 5) <= cc <= (8, 9) or cc[0] == 12),
}
#: TensorRT-RTX ``ComputeCapability`` members the builder compiles for: every one ``RUNS_ON`` admits that the module
#: names (its default set leaves out Turing, 7.5). Recorded in the manifest as "7.5", "8.0", ...
RTX_BUILD_FOR = ("SM75", "SM80", "SM86", "SM89", "SM120", "SM121")


def capability_text(member: str) -> str:
    """'SM75' -> '7.5', 'SM120' -> '12.0'."""
    digits = member[2:]
    return f"{digits[:-1]}.{digits[-1]}"


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


def supported(name: str, version: str) -> bool:
    """Whether ``version`` of module ``name`` lies inside ``SUPPORTED``."""
    try:
        return Version(version) in SpecifierSet(SUPPORTED[name])
    except InvalidVersion:
        return False


def _import(name: str) -> TrtLib:
    """Import one module; ImportError (or a broken install's OSError) becomes an EngineError naming the fix."""
    try:
        module = importlib.import_module(name)
    except (ImportError, OSError) as e:
        raise EngineError(f"cannot import {name} ({type(e).__name__}: {e}): {PIP_HINTS[name]}") from None
    version = str(getattr(module, "__version__", "unknown"))
    if not supported(name, version):
        why = " (10.0 lacks the context-memory calls of 10.1)" if version.startswith("10.0") else ""
        raise EngineError(f"{name} {version} is not supported{why}: eagle-export needs {name} {SUPPORTED[name]}: "
                          f"{PIP_HINTS[name]}")
    return TrtLib(name, module, version)


def module_name(choice: str) -> str | None:
    if choice not in LIB_CHOICES:
        shown = ", ".join(k for k in LIB_CHOICES if "_" not in k)
        raise EngineError(f"engine library {choice!r} is not one of: {shown}")
    return LIB_CHOICES[choice]


def load_lib(choice: str = "auto", capability: tuple[int, int] | None = None) -> TrtLib:
    """``auto``: with a GPU of compute ``capability`` (default: the current CUDA device's, None without one),
    ``tensorrt`` when it imports (and is a supported version), else ``tensorrt_rtx``, only a library that can run
    engines on that GPU; without a GPU ``tensorrt_rtx`` first, the one library that builds there."""
    name = module_name(choice)
    if name is not None:
        return _import(name)
    if capability is None:
        capability = gpu_capability()
    problems = []
    for candidate in AUTO_ORDER if capability is not None else AUTO_ORDER_NO_GPU:
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


def make_builder(lib: TrtLib, logger):
    """``Builder(logger)``, or an EngineError with the reason: ``tensorrt`` on a machine without a usable CUDA GPU
    raises a bare ``TypeError`` (its factory returns null after logging the CUDA error)."""
    try:
        return lib.module.Builder(logger)
    except TypeError as e:
        said = "; ".join(getattr(logger, "errors", []) or [str(e)])
        hint = (" TensorRT-RTX builds without one: --engine-lib tensorrt-rtx (" + PIP_HINTS["tensorrt_rtx"] + ")"
                if not lib.is_rtx else "")
        raise EngineError(f"{lib.label} could not create a builder, it needs a usable CUDA GPU here ({said}).{hint}")\
            from None
