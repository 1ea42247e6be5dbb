"""pyproject.toml's engine extras spell the versions engines/libs.py supports (one source of truth: libs.SUPPORTED),
and the install hints name extras that exist. What PyPI serves for them was checked by hand (docs/engines.md#install):
pip resolves the meta packages and bindings wheels there; the libs wheels come from NVIDIA's index."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from eagle_export.engines import libs

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def extras() -> dict[str, list[Requirement]]:
    raw = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {k: [Requirement(r) for r in v] for k, v in raw.items()}


def test_engine_extras_spell_the_supported_versions():
    got = extras()
    for extra, (dist, module) in libs.EXTRAS.items():
        (req,) = got[extra]
        assert req.name == dist, (extra, req)
        supported = SpecifierSet(libs.SUPPORTED[module])
        if module == "tensorrt":  # a range: the newest release the driver's CUDA takes
            assert req.specifier == supported, (extra, str(req.specifier), libs.SUPPORTED[module])
        else:  # TensorRT-RTX is pinned (CI builds with it): the pin lies inside the supported range
            (pin,) = req.specifier
            assert pin.operator == "==" and pin.version in supported, (extra, pin)
    assert set(libs.EXTRAS) <= set(got)


def test_ci_installs_tensorrt_rtx_through_its_extra():
    assert Requirement("eagle-export[tensorrt-rtx]") in [r for r in extras()["test"] if r.name == "eagle-export"]


def test_install_hints_name_existing_extras():
    names = set(extras())
    for hint in libs.PIP_HINTS.values():
        for extra in (part.split("]")[0] for part in hint.split("eagle-export[")[1:]):
            assert extra in names, (extra, hint)
    assert "onnxruntime-gpu[cuda,cudnn]==1.31.1" in libs.ORT_GPU_INSTALL
    assert libs.ORT_GPU_INSTALL.startswith("pip uninstall -y onnxruntime onnxruntime-gpu && ")
