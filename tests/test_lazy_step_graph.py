"""The draft step graph's session opens when first run (runtime/ort_backend.py): on an artifact whose default tree has
a draft tree graph, the tree graph makes every draft context pass of a request that drafts, the prompt's chunks
included (runtime/generator.py ``_prefill``), so such a runtime holds no session, and no pre-packed copy of the
head, for the step graph. A broken step graph is still refused at open."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from eagle_export import contract as C
from eagle_export.errors import ManifestError
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.ort_backend import _check_graph_file
from eagle_export.tree_params import TreeParams

FIXTURE_PROMPTS = Path(__file__).resolve().parents[1] / "fixture" / "prompts.jsonl"


def _prompt() -> str:
    lines = FIXTURE_PROMPTS.read_text().splitlines()
    return "".join(json.loads(x)["prompt"] for x in lines[:2])


def _draft_cache(rt: EagleRuntime, rows: int) -> np.ndarray:
    return np.stack([b[:rows].numpy().copy() for b in rt.generator.dcache.rows(0, rows)])


def test_a_request_that_drafts_runs_no_step_graph_and_its_chunks_fill_the_draft_cache(trained):
    art = trained("eagle1")
    prompt = _prompt()
    # guard off: every round drafts (the guard's plain rounds feed their tokens through the step graph, by design)
    with EagleRuntime.open(art, threads=1, guard=False, prefill_chunk=8) as rt:
        assert C.DRAFT_GRAPH not in rt.backend.graphs
        n = len(rt.encode(prompt))
        assert n > 3 * 8  # several chunks
        res = rt.generate(prompt, max_new_tokens=32, stop_on_eos=False)
        assert C.DRAFT_GRAPH not in rt.backend.graphs  # no chunk, round or context pass ran it
        chunked = _draft_cache(rt, n)
        plain = rt.generate(prompt, max_new_tokens=32, stop_on_eos=False, use_draft=False)
        assert res.tokens == plain.tokens
    with EagleRuntime.open(art, threads=1, guard=False) as whole:  # the prompt in one chunk
        whole.generate(prompt, max_new_tokens=1, stop_on_eos=False)
        one = _draft_cache(whole, n)
    # every chunk's draft K/V rows written where the whole prompt's pass writes them
    np.testing.assert_allclose(chunked, one, atol=1e-4)
    assert res.stats.tau > 2.0  # the trained head drafts from that cache (the fixture's tau at this tree is ~4)


def test_the_step_graph_opens_when_a_tree_needs_it(trained):
    art = trained("eagle1")
    m = load_manifest(art)
    wide = max(C.tree_graphs(m.graphs)) + 1  # a top_k no tree graph grows: drafted level by level
    assert wide <= m.tree_limits.max_top_k
    with EagleRuntime.open(art, threads=1, guard=False) as rt:
        assert C.DRAFT_GRAPH not in rt.backend.graphs
        tree = TreeParams(top_k=wide, depth=2, total_tokens=6)
        res = rt.generate(_prompt(), max_new_tokens=24, tree=tree, stop_on_eos=False)
        assert C.DRAFT_GRAPH in rt.backend.graphs
        plain = rt.generate(_prompt(), max_new_tokens=24, stop_on_eos=False, use_draft=False)
        assert res.tokens == plain.tokens


@pytest.fixture
def copy(trained, tmp_path):
    out = tmp_path / "art"
    shutil.copytree(trained("eagle1"), out)
    return out


def _weights_file(art: Path) -> Path:
    import onnx

    step = onnx.load(str(art / "draft_step.onnx"), load_external_data=False)
    [loc] = {e.value for t in step.graph.initializer for e in t.external_data if e.key == "location"}
    return art / loc


@pytest.mark.parametrize("how", ["graph_truncated", "weights_truncated", "other_inputs"])
def test_a_broken_step_graph_is_refused_at_open(copy, how):
    step = copy / "draft_step.onnx"
    if how == "graph_truncated":
        step.write_bytes(step.read_bytes()[: step.stat().st_size // 3])
        want = ("could not load graph", str(step))
    elif how == "weights_truncated":
        data = _weights_file(copy)  # shared with the tree graphs, whose open may find it first
        data.write_bytes(data.read_bytes()[:-4096])
        want = ("could not load graph", "re-export")
        with pytest.raises(ManifestError, match=f"its weights file {data} holds"):  # the step graph's own check
            _check_graph_file(copy, load_manifest(copy).graphs[C.DRAFT_GRAPH])
    else:  # the step graph's manifest entry names another graph's file
        raw = json.loads((copy / "manifest.json").read_text())
        raw["graphs"][C.DRAFT_GRAPH]["file"] = raw["graphs"][C.TARGET_GRAPH]["file"]
        (copy / "manifest.json").write_text(json.dumps(raw))
        want = ("inputs/outputs", "re-export")
    with pytest.raises(ManifestError) as info:
        EagleRuntime.open(copy)
    for w in want:
        assert w in str(info.value)
