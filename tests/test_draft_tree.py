"""The draft tree graph (contract 5, export/graphs/draft_tree.py): a round's context pass and tree levels in one call.

It must grow exactly the trees the step graph grows level by level with the host's ``TreeGrower`` (same candidates,
same frontier choice, same verify tree, round after round), in one draft call per round, and fall back to the step
graph for trees it was not traced for. Losslessness on it is shown by test_lossless, test_batched and test_oracle,
which run it wherever the round's tree fits (the session's artifacts carry one for the default tree).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_table import EAGLE3_MODELS

from eagle_export import contract as C
from eagle_export.export.checkpoint.loaders import load_draft_head, load_target
from eagle_export.export.graphs.draft_tree import DraftTree
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.tree import TreeGrower
from eagle_export.tree_params import TreeParams

MODELS = [pytest.param("mha", dict(fc_bias=True), id="eagle1-mha"),
          pytest.param(*EAGLE3_MODELS["llama-d2t"], id="eagle3-llama-d2t")]


def _rounds(rt: EagleRuntime, prompt: list[int], n: int, tree: TreeParams):
    trees = []

    def keep(vt, acc):
        trees.append((vt.tokens.tolist(), vt.parents.tolist(), acc.indices.tolist()))

    res = rt.generate(prompt_ids=prompt, max_new_tokens=n, stop_on_eos=False, tree=tree, on_round=keep)
    return res, trees


@pytest.mark.parametrize("preset, kw", MODELS)
def test_tree_graph_grows_the_step_graphs_trees_in_one_call_a_round(models, preset, kw):
    _, _, art = models(preset, **kw)
    m = load_manifest(art)
    graph_tree = m.tree_defaults
    assert m.graphs[C.DRAFT_TREE_GRAPH].axes[C.TREE_TOP_K] == [graph_tree.top_k] * 2
    one = EagleRuntime.open(art, threads=1)
    levels = EagleRuntime.open(art, threads=1, draft_tree=False)
    assert one.backend.tree_graph == C.DRAFT_TREE_GRAPH and levels.backend.tree_graph is None
    rng = np.random.default_rng(3)
    vocab = m.target.vocab_size
    shallower = TreeParams(top_k=graph_tree.top_k, depth=graph_tree.depth - 1, total_tokens=graph_tree.top_k + 2)
    other_k = TreeParams(top_k=graph_tree.top_k - 1, depth=graph_tree.depth, total_tokens=5)
    for tree in (graph_tree, shallower, other_k):
        for _ in range(2):
            prompt = rng.integers(3, vocab, int(rng.integers(2, 40))).tolist()
            got, got_trees = _rounds(one, prompt, 24, tree)
            want, want_trees = _rounds(levels, prompt, 24, tree)
            assert got.tokens == want.tokens
            # Round by round: the same candidates, the same verify tree, the same acceptance.
            assert got_trees == want_trees, tree
            rounds = got.stats.rounds
            assert want.stats.draft_forwards == rounds * (tree.depth + 1)  # one prefill chunk, no context at the end
            if tree.top_k == graph_tree.top_k:
                assert got.stats.draft_forwards == rounds  # the prefill's call, then one call per continuing round
            else:  # a tree the graph was not traced for: level by level, as before
                assert got.stats.draft_forwards == want.stats.draft_forwards


def test_tree_graph_grows_the_chain_of_the_trained_fixture(trained):
    """The fixture's EAGLE-1/2 artifact has a chain for its default tree (top_k 1, the graph's own shape without a
    frontier choice): the same trees round by round as the step graph, one draft call a round, and a real
    acceptance (a trained head)."""
    art = trained("eagle1")
    m = load_manifest(art)
    assert m.tree_defaults.top_k == 1 and m.graphs[C.DRAFT_TREE_GRAPH].axes[C.TREE_DEPTH][0] == m.tree_defaults.depth
    one = EagleRuntime.open(art, threads=1)
    levels = EagleRuntime.open(art, threads=1, draft_tree=False)
    for prompt in ("def fibonacci(n):", "import numpy as np\n\ndef softmax(x):"):
        ids = one.encode(prompt)
        got, got_trees = _rounds(one, ids, 48, m.tree_defaults)
        want, want_trees = _rounds(levels, ids, 48, m.tree_defaults)
        assert got.tokens == want.tokens and got_trees == want_trees
        assert got.stats.draft_forwards == got.stats.rounds
        assert got.stats.tau > 2.5  # the chain's depth reaches: a trained head accepts several tokens a round


def test_tree_graph_equals_its_module_and_the_growers_choice(models):
    """The traced graph against the eager module it came from, with a frontier choice that is decided by ties in
    generation order: two sequences in one call, one past shared by neither."""
    import onnxruntime as ort

    target, draft, art = models("mha", fc_bias=True)
    m = load_manifest(art)
    tgt = load_target(target, dtype=torch.float32, progress=False)
    head = load_draft_head(draft, tgt).head.eval()
    tree = m.tree_defaults
    module = DraftTree(head, m.tree_limits.max_top_k, tree.top_k, tree.depth).eval()
    d = m.draft
    rng = np.random.default_rng(0)
    b, n, past = 2, 5, 7
    mask = np.zeros((b, n, past + n), dtype=bool)
    mask[0, :, :past] = True
    mask[1, :, :3] = True  # the second sequence owns 3 of the past rows
    mask[:, :, past:] = np.tri(n, dtype=bool)
    mask[1, 3:, past:] = False  # and 3 rows of context: rows 3-4 are padding that sees only itself
    mask[1, 3, past + 3] = mask[1, 4, past + 4] = True
    feed = {
        C.INPUT_EMBEDS: rng.standard_normal((b, n, d.hidden_size)).astype(np.float32),
        C.DRAFT_FEATURES: rng.standard_normal((b, n, d.feature_dim)).astype(np.float32),
        C.POSITION_IDS: np.stack([np.arange(past, past + n), np.r_[np.arange(3, 6), 6, 6]]).astype(np.int64),
        C.ATTENTION_MASK: mask,
        C.LAST_ROW: np.array([n - 1, 2], dtype=np.int64),
    }
    for name in C.past_names(d.num_layers):
        feed[name] = rng.standard_normal((b, past, d.kv_heads, d.head_dim)).astype(np.float32)
    sess = ort.InferenceSession(str(art / m.graphs[C.DRAFT_TREE_GRAPH].file), providers=["CPUExecutionProvider"])
    got = dict(zip(m.graphs[C.DRAFT_TREE_GRAPH].spec.output_names, sess.run(None, feed), strict=True))
    with torch.no_grad():
        want = module(*(torch.from_numpy(feed[k]) for k in m.graphs[C.DRAFT_TREE_GRAPH].spec.input_names))
    want = dict(zip(m.graphs[C.DRAFT_TREE_GRAPH].spec.output_names, (w.numpy() for w in want), strict=True))
    for k in (C.TREE_TOKENS, C.TREE_PARENTS, C.CONTEXT_TOPK_IDS):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for k in (C.TREE_SCORES, C.CONTEXT_TOPK_LOGPROBS, C.CONTEXT_HIDDEN, C.present_key(0)):
        np.testing.assert_allclose(got[k], want[k], atol=2e-4, rtol=1e-4, err_msg=k)
    # The second sequence's tree does not depend on rows it does not own (past rows 3.., its padding rows).
    feed2 = {k: v.copy() for k, v in feed.items()}
    feed2[C.past_key(0)][1, 3:] += 5.0
    feed2[C.DRAFT_FEATURES][1, 3:] += 5.0
    got2 = dict(zip(m.graphs[C.DRAFT_TREE_GRAPH].spec.output_names, sess.run(None, feed2), strict=True))
    np.testing.assert_array_equal(got2[C.TREE_TOKENS][1], got[C.TREE_TOKENS][1])
    np.testing.assert_allclose(got2[C.TREE_SCORES][1], got[C.TREE_SCORES][1], atol=1e-5)
    # Candidates are in the grower's generation order: level 1 under the root, then k x k per level, row-major.
    k = tree.top_k
    parents = got[C.TREE_PARENTS]
    assert (parents[:, :k] == -1).all()
    for level in range(1, tree.depth + 1):
        start = k + (level - 1) * k * k
        block = parents[:, start:start + k * k].reshape(b, k, k)
        assert (block == block[:, :, :1]).all()  # the k children of one frontier node are adjacent
        assert (block[:, :, 0] < start).all()  # parents precede their children


@pytest.fixture(scope="module")
def tied_scores(tmp_path_factory) -> Path:
    """An artifact whose draft scores tie: the target's lm_head (the EAGLE-1/2 draft's too) is zero but for its
    first column, 2 for token 5 and 1 for tokens 6 and 7, so a node's log-probs for 6 and 7 are equal to the last
    bit (one product each) and, where the hidden's first value is negative, those of every other token too."""
    from safetensors.torch import load_file, save_file

    from eagle_export.export.exporter import ExportOptions, export_artifact
    from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_target

    root = tmp_path_factory.mktemp("tied_scores")
    target = make_tiny_target(root / "target", "mha", with_tokenizer=False, vocab_size=48)
    path = target / "model.safetensors"
    weights = load_file(str(path))
    lm_head = torch.zeros_like(weights["lm_head.weight"])
    lm_head[5, 0], lm_head[6, 0], lm_head[7, 0] = 2.0, 1.0, 1.0
    weights["lm_head.weight"] = lm_head
    save_file(weights, str(path))
    draft = make_tiny_draft(root / "draft", target, seed=1)
    return export_artifact(target, draft, root / "artifact", ExportOptions(max_seq_len=64, fused=False),
                           progress=False)


def test_tree_graph_breaks_ties_as_the_grower_does(tied_scores):
    """Candidates with equal scores: the graph's frontier at each level is the one ``TreeGrower`` picks from the
    same per-node log-probs (ties: the lower candidate index, first), so every candidate's parent, token and score
    are the grower's. The log-probs are the graph's own (each candidate's score less its parent's, exact in
    float64), fed level by level to a grower, which chooses its frontier itself."""
    import onnxruntime as ort

    m = load_manifest(tied_scores)
    d, tree, entry = m.draft, m.tree_defaults, m.graphs[C.DRAFT_TREE_GRAPH]
    k = tree.top_k
    rng = np.random.default_rng(0)
    b, n, past = 2, 5, 7
    mask = np.zeros((b, n, past + n), dtype=bool)
    mask[:, :, :past] = True
    mask[:, :, past:] = np.tri(n, dtype=bool)
    feed = {
        C.INPUT_EMBEDS: rng.standard_normal((b, n, d.hidden_size)).astype(np.float32),
        C.DRAFT_FEATURES: rng.standard_normal((b, n, d.feature_dim)).astype(np.float32),
        C.POSITION_IDS: np.tile(np.arange(past, past + n), (b, 1)).astype(np.int64),
        C.ATTENTION_MASK: mask,
        C.LAST_ROW: np.array([n - 1, n - 2], dtype=np.int64),
    }
    for name in C.past_names(d.num_layers):
        feed[name] = rng.standard_normal((b, past, d.kv_heads, d.head_dim)).astype(np.float32)
    sess = ort.InferenceSession(str(tied_scores / entry.file), providers=["CPUExecutionProvider"])
    got = dict(zip(entry.spec.output_names, sess.run(None, feed), strict=True))
    tied_choices = 0
    for i in range(b):
        scores = got[C.TREE_SCORES][i].astype(np.float64)
        tokens, parents = got[C.TREE_TOKENS][i], got[C.TREE_PARENTS][i]
        grower = TreeGrower(tree)
        grower.add_root_children(got[C.CONTEXT_TOPK_LOGPROBS][i], got[C.CONTEXT_TOPK_IDS][i])
        for level in range(1, tree.depth + 1):
            block = slice(k + (level - 1) * k * k, k + level * k * k)
            rows = parents[block].reshape(k, k)[:, 0]  # the graph's frontier, one row per node
            grower.add_children(scores[block].reshape(k, k) - scores[rows][:, None], tokens[block].reshape(k, k))
            if level < tree.depth:  # a frontier choice among equal scores (in the chosen k, or at its edge)
                best = np.sort(scores[block])[::-1][:k + 1]
                tied_choices += len(set(best.tolist())) < k + 1
        np.testing.assert_array_equal(grower.candidate_parents, parents, err_msg=f"sequence {i}")
        np.testing.assert_array_equal(grower.candidate_tokens, tokens, err_msg=f"sequence {i}")
        np.testing.assert_array_equal(grower.scores, scores, err_msg=f"sequence {i}")
    assert tied_choices >= 2  # the ties really were in the frontier choices


def test_tensorrt_rtx_builds_the_tree_graph(models):
    """The tree graph is standard operators (TopK, GatherElements, Concat): TensorRT-RTX builds it ahead of time, for
    an EAGLE-3 head with a draft vocabulary (its d2t map inside). The runtime's TensorRT backend still drafts with
    the step graph (docs/engines.md)."""
    from eagle_export.engines import builder as B
    from eagle_export.engines.libs import load_lib
    from eagle_export.engines.profiles import make_profile

    preset, kw = EAGLE3_MODELS["llama-d2t"]
    _, _, art = models(preset, **kw)
    m = load_manifest(art)
    entry = m.graphs[C.DRAFT_TREE_GRAPH]
    profile = make_profile("round", entry, {C.BATCH: (1, 1, 1), C.NEW_TOKENS: (1, 4, 8), C.PAST_LEN: (0, 32, 64)})
    built = B.build_graph(load_lib("tensorrt-rtx"), art / entry.file, C.DRAFT_TREE_GRAPH, entry.spec, [profile])
    assert len(built.data) > 10_000 and [p.name for p in built.profiles] == ["round"]
