"""A float32 artifact's chain tree graph sessions compute from one copy of the draft weights: the artifact's data
files, mapped once (runtime/shared_weights.py). Shown end to end: the weights are changed in the file under an open
runtime, and each chain session's next call computes with the new bytes, as a runtime opened afresh on the changed
file does. A session holding a copy of its own (loaded, folded or pre-packed) would still draft with the old ones."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.ort_backend import shares_draft_weights
from eagle_export.runtime.shared_weights import SharedWeights
from eagle_export.tree_params import TreeParams

# Two chains: the top_k 1 tree graph cut to two depths, two sessions open at once.
TREES = (TreeParams(top_k=1, depth=3, total_tokens=3), TreeParams(top_k=1, depth=2, total_tokens=2))
PROMPT = [3, 9, 27, 33, 11, 5, 40, 2, 17]


@pytest.fixture(scope="module")
def lean(models, tmp_path_factory):
    """The tiny model exported on the lean path (as every target of 256 MiB and more is): its tree graphs read some
    matrices through a Transpose and q, k, v through Concat, which the in-memory path's tracer folds at export."""
    target, draft, _ = models("mha")
    out = tmp_path_factory.mktemp("lean") / "art"
    return export_artifact(target, draft, out, ExportOptions(lean_threshold_bytes=0), progress=False)


def _drafts(rt: EagleRuntime, tree: TreeParams) -> list[list[int]]:
    """The verify trees' tokens, round by round: what the draft proposed."""
    seen: list[list[int]] = []
    rt.generate(prompt_ids=PROMPT, max_new_tokens=16, tree=tree, stop_on_eos=False,
                on_round=lambda verify, accepted: seen.append(verify.tokens.tolist()))
    return seen


def _negate_lm_head_in_place(art, vocab: int) -> None:
    """The draft's lm_head (the step graph's stored [hidden, vocab] matrix, which the tree graphs point at too)
    negated in the file itself: the page cache's pages, which a mapping of it shows at once. Its top-k becomes its
    least likely tokens. (A weight the runtime computes from, such as q, k and v made one matrix, is computed when a
    session opens: changing it under an open runtime would show nothing.)"""
    step = onnx.load(str(art / "draft_step.onnx"), load_external_data=False)
    [(file, offset, length)] = [
        (e["location"], int(e.get("offset", 0)), int(e["length"]))
        for t in step.graph.initializer if len(t.dims) == 2 and t.dims[1] == vocab
        for e in [{x.key: x.value for x in t.external_data}]]
    with open(art / file, "r+b") as f:
        f.seek(offset)
        data = np.frombuffer(f.read(length), dtype=np.float32)
        f.seek(offset)
        f.write((-data).tobytes())


def test_every_chain_session_computes_from_the_artifacts_one_copy(lean, tmp_path):
    art = shutil.copytree(lean, tmp_path / "art")  # changed in place below
    with EagleRuntime.open(art, threads=1, guard=False) as rt:
        assert shares_draft_weights(rt.manifest, rt.backend.device)
        before = [_drafts(rt, tree) for tree in TREES]
        sessions = dict(rt.backend.graphs)
        assert sum(name.startswith("draft_tree") for name in sessions) == 2
        _negate_lm_head_in_place(art, rt.manifest.target.vocab_size)
        after = [_drafts(rt, tree) for tree in TREES]
        assert rt.backend.graphs == sessions  # the same sessions: none reopened on the changed file
    with EagleRuntime.open(art, threads=1, guard=False) as fresh:
        expected = [_drafts(fresh, tree) for tree in TREES]
    for tree, b, a, e in zip(TREES, before, after, expected, strict=True):
        assert a == e, f"{tree}: an open draft session computed from a copy of its own"
        assert a != b, f"{tree}: changing the weights did not change the draft (the test shows nothing)"


def test_weights_computed_from_stored_ones_are_computed_once(lean):
    """The chain graph reads ``fc`` through a Transpose, and q, k and v as one matrix through Reshape, Concat and
    Transpose: ONNX Runtime would fold each into a copy of its own in every session. ``prepare`` takes them out of the
    graph: ``fc`` transposed is exactly a tensor the step graph stores, and is that tensor; the q, k, v matrix is one
    array for every session."""
    art = lean
    shared = SharedWeights(art)
    step = shared.prepare(onnx.load(str(art / "draft_step.onnx"), load_external_data=False))[0]
    values = []
    for _ in range(2):  # two sessions' graphs
        tree = onnx.load(str(art / "draft_tree_k1.onnx"), load_external_data=False)
        stored = {t.name for t in tree.graph.initializer}
        assert any(n.op_type == "Transpose" and n.input[0] in stored for n in tree.graph.node)
        got, changed = shared.prepare(tree)
        names = {t.name for t in tree.graph.initializer}
        assert changed and not any(n.op_type in ("Transpose", "Concat") and set(n.input) <= names
                                   for n in tree.graph.node)
        values.append({name: v for name, v in got.items() if name not in stored})  # the computed ones
    computed = values[0]  # each level's node outputs: ONNX Runtime's own folding would make one a session
    assert values[0].keys() == values[1].keys()
    assert all(values[1][name] is v for name, v in computed.items())  # once for both sessions
    distinct = {id(v): v for v in computed.values()}.values()
    assert len(distinct) == 2
    assert sum(any(v is w for w in step.values()) for v in distinct) == 1  # fc: the stored tensor
    common = {id(v) for v in step.values()} & {id(v) for v in got.values()}
    assert len(common) >= 4  # fc, the MLP and the lm_head at least, matched by where they are stored
