"""Real TensorRT builds in CI: TensorRT-RTX builds engines ahead of time on a CPU-only machine.

Both graphs of small fp32, fp16 and bf16 artifacts are built with the profiles of engines/profiles.py;
the manifest must record the profiles TensorRT read back (equal to what profiles.py computed), and a
graph TensorRT cannot take must fail with a message carrying TensorRT's own text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from eagle_export import contract as C
from eagle_export.cli import main
from eagle_export.engines import builder as B
from eagle_export.engines.libs import load_lib
from eagle_export.engines.profiles import (
    Profile,
    graph_profiles,
    make_profile,
    resolve_options,
    tree_engine_calls,
    tree_profiles,
)
from eagle_export.errors import EngineError
from eagle_export.manifest import MANIFEST_NAME, Manifest, load_manifest

RTX_VERSION = "1.7.1.116"  # pinned in pyproject.toml's test extra


@pytest.fixture(scope="module")
def rtx():
    lib = load_lib("tensorrt-rtx")
    assert lib.version == RTX_VERSION
    return lib


@pytest.mark.parametrize("dtype, precision", [("fp32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16")])
def test_build_both_graphs(engines, rtx, dtype, precision):
    art = engines(dtype)
    m = load_manifest(art)
    assert m.dtype == precision
    e = m.engines
    assert e is not None and e.lib == "tensorrt_rtx" and e.lib_version == RTX_VERSION
    # TensorRT-RTX compiles for the compute capabilities named at build (its default set leaves out Turing): 7.5 for
    # fp16 only, as TensorRT-RTX refuses fp32 GEMMs for SM75 and Turing has no bf16.
    built_for = ["7.5"] * (dtype == "fp16") + ["8.0", "8.6", "8.9", "12.0", "12.1"]
    assert e.options == {"max_batch": 1, "max_prefill": 64, "max_tree_tokens": 13, "workspace": None,
                         "timing_cache": None, "compute_capabilities": built_for}
    opts = resolve_options(m)
    # The standard graphs, and the draft tree graph of the default tree's top_k cut to its depth (4, 3).
    call = C.tree_call(m.tree_defaults.top_k, m.tree_defaults.depth)
    assert tree_engine_calls(m) == [(4, 3)]
    assert set(e.graphs) == {C.TARGET_GRAPH, C.DRAFT_GRAPH, call}
    # engines/round_ops.py's operators appended: the verify engine's acceptance, the tree engine's 12-node selection
    assert {n: g.appended for n, g in e.graphs.items()} == {C.TARGET_GRAPH: {"accept": True}, C.DRAFT_GRAPH: {},
                                                             call: {"select": 12}}
    for name, g in e.graphs.items():
        path = art / g.file
        assert path.is_file() and path.stat().st_size == g.size_bytes > 100_000
        assert g.precision == precision and g.strongly_typed and g.build_s > 0
        # The profiles TensorRT read back from its optimisation profiles equal what profiles.py computed.
        expected = [p.to_dict() for p in (tree_profiles(m, 4, 3, opts) if name == call
                                          else graph_profiles(m, name, opts))]
        assert g.profiles == expected
        assert [p["name"] for p in g.profiles] == {C.TARGET_GRAPH: ["prefill", "verify"],
                                                   C.DRAFT_GRAPH: ["context", "tree"],
                                                   call: ["prefill", "round"]}[name]
    # No temporary files are left behind and the manifest round-trips with its engines entry.
    assert not [p for p in art.iterdir() if p.name.endswith(".partial")]
    raw = json.loads((art / MANIFEST_NAME).read_text())
    assert Manifest.from_dict(raw).to_dict() == raw
    print(f"\n{dtype}: engines built in {engines.build_seconds[(dtype,)]:.1f} s "
          f"({', '.join(f'{n} {g.build_s:.1f} s' for n, g in e.graphs.items())})")


def test_profile_violating_a_shape_constraint_fails_clearly(engines, rtx):
    """The opt mask is one column wider than past + new: TensorRT's shape check refuses it, and says so."""
    art = engines.artifact("fp32")
    m = load_manifest(art)
    entry = m.graphs[C.TARGET_GRAPH]
    good = graph_profiles(m, C.TARGET_GRAPH, resolve_options(m))
    bad = make_profile("prefill", entry, {a: v for a, v in good[0].axes.items() if a != C.TOTAL_LEN})
    lo, opt, hi = bad.shapes[C.ATTENTION_MASK]
    bad.shapes[C.ATTENTION_MASK] = (lo, (opt[0], opt[1], opt[2] + 1), hi)
    with pytest.raises(EngineError) as info:
        B.build_graph(rtx, art / entry.file, C.TARGET_GRAPH, entry.spec, [bad, good[1]])
    msg = str(info.value)
    for fragment in ("could not build graph target_verify", "target_verify.onnx", f"tensorrt_rtx {RTX_VERSION}",
                     "0 prefill: batch 1/1/1, new_tokens 1/64/64", "kOPT", "violate shape constraints",
                     "profile prefill opt attention_mask [1, 64, 65] (axes give [1, 64, 64])"):
        assert fragment in msg, (fragment, msg)


def test_unparsable_graph_fails_clearly(engines, rtx, tmp_path):
    art = shutil.copytree(engines.artifact("fp32"), tmp_path / "art")
    m = load_manifest(art)
    entry = m.graphs[C.DRAFT_GRAPH]
    (art / entry.file).write_bytes(b"\x08\x07garbage")
    with pytest.raises(EngineError) as info:
        B.build_graph(rtx, art / entry.file, C.DRAFT_GRAPH, entry.spec,
                      graph_profiles(m, C.DRAFT_GRAPH, resolve_options(m)))
    msg = str(info.value)
    assert "could not parse graph draft_step (draft_step.onnx" in msg
    assert len(msg.splitlines()) >= 2  # TensorRT's own parser messages follow


def test_profile_missing_an_input_is_named(engines, rtx):
    art = engines.artifact("fp32")
    m = load_manifest(art)
    entry = m.graphs[C.DRAFT_GRAPH]
    p = graph_profiles(m, C.DRAFT_GRAPH, resolve_options(m))[0]
    shapes = {n: s for n, s in p.shapes.items() if n != "past_value.0"}
    with pytest.raises(EngineError, match=r"profile context lacks inputs \['past_value.0'\]"):
        B.build_graph(rtx, art / entry.file, C.DRAFT_GRAPH, entry.spec, [Profile(p.name, p.axes, shapes)])


def test_failed_build_leaves_the_artifact_untouched(engines, tmp_path, monkeypatch):
    """The target builds, the draft fails: no engine files, no partial files, the manifest as it was."""
    art = shutil.copytree(engines.artifact("fp32"), tmp_path / "art")
    before = (art / MANIFEST_NAME).read_text()
    real = B.graph_profiles

    def broken(manifest, graph, opts):
        profiles = real(manifest, graph, opts)
        if graph == C.DRAFT_GRAPH:
            lo, opt, hi = profiles[1].shapes[C.ATTENTION_MASK]
            profiles[1].shapes[C.ATTENTION_MASK] = (lo, (opt[0], opt[1], opt[2] - 1), hi)
        return profiles

    monkeypatch.setattr(B, "graph_profiles", broken)
    with pytest.raises(EngineError, match="could not build graph draft_step"):
        B.build_engines(art, B.BuildOptions(engine_lib="tensorrt-rtx"), progress=False)
    assert (art / MANIFEST_NAME).read_text() == before
    assert sorted(p.name for p in art.iterdir() if "engine" in p.name or "partial" in p.name) == []


def test_cli_build_with_options(engines, tmp_path):
    art = shutil.copytree(engines.artifact("fp16"), tmp_path / "art")
    cache = tmp_path / "timing.cache"
    res = CliRunner().invoke(main, ["build", str(art), "--engine-lib", "tensorrt-rtx", "--max-prefill", "16",
                                    "--max-tree-tokens", "8", "--workspace", "256M", "--timing-cache", str(cache)])
    assert res.exit_code == 0, res.output
    # stderr is not a terminal here: one progress line per engine, no redrawn bar.
    assert "\r" not in res.stderr
    progress = [ln for ln in res.stderr.splitlines() if ln.startswith("build ")]
    assert [ln.split(" (")[0] for ln in progress] == ["build target_verify: 1/3 engines",
                                                      "build draft_step: 2/3 engines",
                                                      "build draft_tree_k4_d3: 3/3 engines"], res.stderr
    lines = res.output.strip().splitlines()
    assert any(ln.startswith("target_verify: target_verify.engine") and "prefill: new_tokens 1..16" in ln
               and "verify: new_tokens 1..8" in ln for ln in lines), res.output
    assert lines[-1] == f"built with tensorrt_rtx {RTX_VERSION} into {art}"
    e = load_manifest(art).engines
    # TensorRT-RTX has no timing cache: the option is ignored (with a warning) and not recorded.
    assert e.options == {"max_batch": 1, "max_prefill": 16, "max_tree_tokens": 8, "workspace": 256 * 2**20,
                         "timing_cache": None, "compute_capabilities": ["7.5", "8.0", "8.6", "8.9", "12.0", "12.1"]}
    assert not cache.exists()
    assert e.graphs[C.TARGET_GRAPH].profiles[1]["axes"]["logit_rows"] == [1, 8, 8]


@pytest.mark.parametrize("args, expect", [
    (["--max-tree-tokens", "99"], "--max-tree-tokens must be an integer in [2, 13]"),
    (["--max-batch", "2"], "--max-batch must be an integer in [1, 1]"),
    (["--workspace", "lots"], "--workspace 'lots' is not a size"),
])
def test_cli_build_bad_options(engines, args, expect):
    res = CliRunner().invoke(main, ["build", str(engines.artifact("fp32")), "--quiet", *args])
    assert res.exit_code == 2 and res.output.startswith(f"error: {expect}"), res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_build_not_an_artifact(tmp_path):
    res = CliRunner().invoke(main, ["build", str(tmp_path), "--quiet"])
    assert res.exit_code == 2 and "no manifest.json" in res.output


@pytest.mark.parametrize("text, value", [("512M", 512 * 2**20), ("2G", 2 * 2**30), ("1.5GiB", 3 * 2**29),
                                         ("1048576", 2**20), ("64k", 65536), (None, None)])
def test_parse_size(text, value):
    assert B.parse_size(text) == value


def test_engine_files_are_named_after_graphs(engines):
    e = load_manifest(engines("fp32")).engines
    assert {n: g.file for n, g in e.graphs.items()} == {n: f"{n}.engine" for n in (C.TARGET_GRAPH, C.DRAFT_GRAPH,
                                                                                 C.tree_call(4, 3))}
    assert Path(engines("fp32"), "target_verify.onnx").is_file()  # the ONNX graphs stay for the ort backend


def test_manifest_without_engines_still_loads(engines, tmp_path):
    """Manifests written before `build` existed (no `engines` key) load, and write back without the key."""
    art = shutil.copytree(engines("fp32"), tmp_path / "art")
    raw = json.loads((art / MANIFEST_NAME).read_text())
    assert "engines" in raw
    raw.pop("engines")
    (art / MANIFEST_NAME).write_text(json.dumps(raw))
    m = load_manifest(art)
    assert m.engines is None and m.to_dict() == raw


def test_build_a_quantized_artifact(models, rtx, tmp_path):
    """`export --quantize int4 --quantize-draft` (symmetric, block 32): both graphs TensorRT builds hold INT4
    DequantizeLinear -> MatMul weights, and TensorRT-RTX builds them (int8 symmetric builds too, checked by hand:
    docs/engines.md)."""
    from conftest import ENGINE_MODEL

    from eagle_export.export.quantization.artifact import QuantizeOptions

    art = tmp_path / "art"
    shutil.copytree(models(**ENGINE_MODEL, quantize=QuantizeOptions(bits=4, draft=True))[2], art)
    m = B.build_engines(art, progress=False)
    assert m.quantization.graphs[C.TARGET_GRAPH] == m.quantization.graphs[C.DRAFT_GRAPH] == "qdq"
    assert set(m.engines.graphs) == set(C.ENGINE_GRAPHS)
    for g in m.engines.graphs.values():
        assert (art / g.file).stat().st_size == g.size_bytes > 10_000
        assert [p["name"] for p in g.profiles] in (["prefill", "verify"], ["context", "tree"])
