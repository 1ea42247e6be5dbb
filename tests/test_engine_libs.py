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
    assert "pip install tensorrt-rtx-cu12==1.7.1.116" in msg and "pip install tensorrt " in msg


def test_unknown_choice():
    with pytest.raises(EngineError, match="engine library 'trt' is not one of: auto, tensorrt, tensorrt-rtx"):
        load_lib("trt")
