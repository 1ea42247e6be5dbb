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
    lib = load_lib("auto")
    assert (lib.name, lib.version, lib.is_rtx) == ("tensorrt", "10.13.3.9", False)


def test_auto_falls_back_to_rtx(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    assert load_lib("auto").name == "tensorrt_rtx"


def test_auto_skips_an_unsupported_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "8.6.1"))
    assert load_lib("auto").name == "tensorrt_rtx"


def test_explicit_unsupported_version(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_module("tensorrt", "8.6.1"))
    with pytest.raises(EngineError, match=r"tensorrt 8\.6\.1 is not supported: eagle-export needs tensorrt 10\.x or"):
        load_lib("tensorrt")


def test_neither_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    with pytest.raises(EngineError) as info:
        load_lib("auto")
    msg = str(info.value)
    assert "no TensorRT Python module is usable" in msg
    assert "pip install 'eagle-export[engines]'" in msg and "tensorrt-rtx-cu12==1.7.1.116" in msg
    assert "pip install tensorrt " in msg


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
