"""engines/libs.py: one name for tensorrt and tensorrt_rtx, `auto` preference, clear errors naming the pip package."""

from __future__ import annotations

import sys
import types

import pytest

from eagle_export.engines.libs import load_lib
from eagle_export.errors import EngineError


def fake_module(name: str, version: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__version__ = version
    return m


def test_rtx_is_installed_for_ci():
    lib = load_lib("tensorrt-rtx")
    assert lib.name == "tensorrt_rtx" and lib.is_rtx and lib.version.startswith("1.")
    assert hasattr(lib.module, "Builder") and hasattr(lib.module, "OnnxParser")


def test_auto_prefers_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "10.13.3.9"))
    lib = load_lib("auto", capability=(9, 0))
    assert (lib.name, lib.version, lib.is_rtx) == ("tensorrt", "10.13.3.9", False)


def test_auto_falls_back_to_rtx(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    assert load_lib("auto").name == "tensorrt_rtx"


def test_auto_skips_an_unsupported_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "8.6.1"))
    assert load_lib("auto").name == "tensorrt_rtx"


def test_explicit_unsupported_version(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "8.6.1"))
    with pytest.raises(EngineError, match=r"tensorrt 8\.6\.1 is not supported: eagle-export needs tensorrt "
                                          r">=10\.1,<12"):
        load_lib("tensorrt")


def test_neither_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    with pytest.raises(EngineError) as info:
        load_lib("auto")
    msg = str(info.value)
    assert "no TensorRT Python module is usable" in msg
    assert "pip install 'eagle-export[tensorrt-rtx]'" in msg and "pip install 'eagle-export[tensorrt]'" in msg


def test_unknown_choice():
    with pytest.raises(EngineError, match="engine library 'trt' is not one of: auto, tensorrt, tensorrt-rtx"):
        load_lib("trt")


def test_auto_skips_a_library_that_cannot_run_on_the_gpu(monkeypatch):
    """On a Hopper GPU (9.0) TensorRT-RTX cannot run engines: auto must not pick it, even if it is all there is."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    assert load_lib("auto", capability=(8, 9)).name == "tensorrt_rtx"  # an RTX 40xx
    assert load_lib("auto", capability=(12, 0)).name == "tensorrt_rtx"  # an RTX 50xx
    with pytest.raises(EngineError) as info:
        load_lib("auto", capability=(9, 0))
    assert "tensorrt_rtx cannot run on compute capability 9.0" in str(info.value)
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "10.13.3.9"))
    assert load_lib("auto", capability=(9, 0)).name == "tensorrt"


def test_cannot_run():
    from eagle_export.engines.libs import cannot_run

    assert cannot_run("tensorrt", (9, 0)) is None and cannot_run("tensorrt", (7, 0)) is not None
    assert cannot_run("tensorrt_rtx", (8, 6)) is None and cannot_run("tensorrt_rtx", (12, 0)) is None
    assert "data-centre" in cannot_run("tensorrt_rtx", (9, 0)) and cannot_run("tensorrt_rtx", (10, 0))


def fake_tensorrt_10_0() -> types.ModuleType:
    """TensorRT 10.0 as documented: ICudaEngine has get_device_memory_size (no per-profile _v2) and
    IExecutionContext.set_device_memory takes no size; both calls the backend makes are 10.1's."""
    m = fake_module("tensorrt", "10.0.1")

    class ICudaEngine:
        def get_device_memory_size(self) -> int:
            return 0

    class IExecutionContext:
        def set_device_memory(self, memory: int) -> None:
            pass

    m.ICudaEngine, m.IExecutionContext = ICudaEngine, IExecutionContext
    return m


def test_tensorrt_10_0_is_refused(monkeypatch):
    """10.0 lacks what the backend's shared context memory needs: refused by name, and auto passes it over."""
    m = fake_tensorrt_10_0()
    assert not hasattr(m.ICudaEngine, "get_device_memory_size_for_profile_v2")
    monkeypatch.setitem(sys.modules, "tensorrt", m)
    with pytest.raises(EngineError, match=r"tensorrt 10\.0\.1 is not supported \(10\.0 lacks the context-memory calls "
                                          r"of 10\.1\): eagle-export needs tensorrt >=10\.1,<12"):
        load_lib("tensorrt")
    assert load_lib("auto", capability=(8, 9)).name == "tensorrt_rtx"
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "10.1.0"))
    assert load_lib("tensorrt").version == "10.1.0"
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "11.4.0.106"))
    assert load_lib("tensorrt").version == "11.4.0.106"
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "12.0.0"))
    with pytest.raises(EngineError, match="is not supported"):
        load_lib("tensorrt")


def fake_cpu_only_tensorrt() -> types.ModuleType:
    """``tensorrt`` installed on a machine without a usable CUDA GPU: ``Builder(logger)`` logs the CUDA error and
    raises a bare TypeError (its factory returns null), as NVIDIA's wheels do."""
    m = fake_module("tensorrt", "10.13.3.9")

    class ILogger:
        class Severity:
            INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        def __init__(self):
            pass

    class Builder:
        def __init__(self, logger):
            logger.log(ILogger.Severity.ERROR, "CUDA initialization failure with error: 35")
            raise TypeError("pybind11::init(): factory function returned nullptr")

    m.ILogger, m.Builder = ILogger, Builder
    return m


def test_tensorrt_without_a_gpu(monkeypatch, engines):
    """auto takes TensorRT-RTX when there is no GPU (it builds ahead of time), and an explicit tensorrt fails with
    the reason and the way out, not a bare TypeError."""
    from eagle_export import contract as C
    from eagle_export.engines import builder as B
    from eagle_export.engines.profiles import graph_profiles, resolve_options
    from eagle_export.manifest import load_manifest

    art = engines.artifact("fp32")  # before the fake module: transformers looks for tensorrt when it makes models
    m = load_manifest(art)
    entry = m.graphs[C.DRAFT_GRAPH]
    monkeypatch.setitem(sys.modules, "tensorrt", fake_cpu_only_tensorrt())
    monkeypatch.setattr("eagle_export.engines.libs.gpu_capability", lambda: None)
    assert load_lib("auto").name == "tensorrt_rtx"
    with pytest.raises(EngineError) as info:
        B.build_graph(load_lib("tensorrt"), art / entry.file, C.DRAFT_GRAPH, entry.spec,
                      graph_profiles(m, C.DRAFT_GRAPH, resolve_options(m)))
    msg = str(info.value)
    assert msg.startswith("tensorrt 10.13.3.9 could not create a builder, it needs a usable CUDA GPU here (CUDA "
                          "initialization failure with error: 35). TensorRT-RTX builds without one: --engine-lib "
                          "tensorrt-rtx"), msg
