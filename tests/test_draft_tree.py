"""The draft tree graphs (contract 6, export/graphs/draft_tree.py): a round's context pass and tree levels in one call.

They must grow exactly the trees the step graph grows level by level with the host's ``TreeGrower`` (same candidates,
same frontier choice, same verify tree, round after round), in one draft call per round, at any depth up to the
artifact's (the runtime cuts a graph to a round's depth, runtime/tree_graph.py), and leave trees of a top_k without
a graph to the step graph. Losslessness on them is shown by test_lossless, test_batched and test_oracle, which run
them wherever the round's tree fits (the session's artifacts carry graphs for top_k 1 to 4).
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
from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_eagle3_draft, make_tiny_target
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
    graphs = C.tree_graphs(m.graphs)
    assert set(graphs) == {1, 2, 3, 4} and {d for _, d in graphs.values()} == {m.tree_limits.max_depth}
    assert m.graphs[graphs[graph_tree.top_k][0]].axes[C.TREE_TOP_K] == [graph_tree.top_k] * 2
    one = EagleRuntime.open(art, threads=1)
    levels = EagleRuntime.open(art, threads=1, draft_tree=False)
    assert one.backend.tree_graph == C.DRAFT_TREE_GRAPH and levels.backend.tree_graph is None
    rng = np.random.default_rng(3)
    vocab = m.target.vocab_size
    shallower = TreeParams(top_k=graph_tree.top_k, depth=graph_tree.depth - 1, total_tokens=graph_tree.top_k + 2)
    other_k = TreeParams(top_k=graph_tree.top_k - 1, depth=graph_tree.depth, total_tokens=5)
    deeper = TreeParams(top_k=2, depth=m.tree_limits.max_depth, total_tokens=9)
    no_graph = TreeParams(top_k=5, depth=2, total_tokens=6)  # no graph for top_k 5: the step graph, level by level
    for tree in (graph_tree, shallower, other_k, deeper, no_graph):
        for _ in range(2):
            prompt = rng.integers(3, vocab, int(rng.integers(2, 40))).tolist()
            got, got_trees = _rounds(one, prompt, 24, tree)
            want, want_trees = _rounds(levels, prompt, 24, tree)
            assert got.tokens == want.tokens
            # Round by round: the same candidates, the same verify tree, the same acceptance.
            assert got_trees == want_trees, tree
            rounds = got.stats.rounds
            assert want.stats.draft_forwards == rounds * (tree.depth + 1)  # one prefill chunk, no context at the end
            if tree.top_k in graphs:
                assert got.stats.draft_forwards == rounds  # the prefill's call, then one call per continuing round
            else:  # a tree no graph was traced for: level by level, as before
                assert got.stats.draft_forwards == want.stats.draft_forwards


def test_tree_graph_grows_the_chain_of_the_trained_fixture(trained):
    """The fixture's EAGLE-1/2 artifact has a chain for its default tree (top_k 1, the graph's own shape without a
    frontier choice): the same trees round by round as the step graph, one draft call a round, and a real
    acceptance (a trained head)."""
    art = trained("eagle1")
    m = load_manifest(art)
    assert m.tree_defaults.top_k == 1 and 1 in C.tree_graphs(m.graphs)
    one = EagleRuntime.open(art, threads=1)
    levels = EagleRuntime.open(art, threads=1, draft_tree=False)
    for prompt in ("def fibonacci(n):", "import numpy as np\n\ndef softmax(x):"):
        ids = one.encode(prompt)
        got, got_trees = _rounds(one, ids, 48, m.tree_defaults)
        want, want_trees = _rounds(levels, ids, 48, m.tree_defaults)
        assert got.tokens == want.tokens and got_trees == want_trees
        assert got.stats.draft_forwards == got.stats.rounds
        assert got.stats.tau > 2.5  # the chain's depth reaches: a trained head accepts several tokens a round


def _tree_session(art, m, top_k: int, depth: int):
    """An ONNX Runtime session of the artifact's draft tree graph for ``top_k``, cut to ``depth`` levels, as the
    runtime makes it (runtime/tree_graph.py)."""
    import onnx
    import onnxruntime as ort

    from eagle_export.runtime.tree_graph import cut

    name, most = C.tree_graphs(m.graphs)[top_k]
    model = cut(onnx.load(str(art / m.graphs[name].file), load_external_data=False), top_k, depth, most)
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(art))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def test_a_tree_deeper_than_its_total_tokens_reach_drafts_only_the_levels_it_verifies(trained):
    """A chain 1/8/5 verifies at most 5 nodes, so its levels 6-9 are never verified: the runtime drafts it as 1/4/5
    (TreeParams.trimmed) on both draft paths (the tree graph cut to depth 4, or 4 step-graph levels after the context
    pass), with the tokens and round-by-round verify trees of 1/4/5 (planted: a runtime that drafts the 8 levels makes
    9 step-graph calls a round and opens the depth-8 cut)."""
    art = trained("eagle1")
    deep, trimmed = TreeParams(1, 8, 5), TreeParams(1, 4, 5)
    one = EagleRuntime.open(art, threads=1, guard=False)
    levels = EagleRuntime.open(art, threads=1, draft_tree=False, guard=False)
    ids = one.encode("def fibonacci(n):")
    got, got_trees = _rounds(one, ids, 40, deep)
    want, want_trees = _rounds(levels, ids, 40, trimmed)
    by_levels, by_levels_trees = _rounds(levels, ids, 40, deep)
    assert got.tokens == want.tokens == by_levels.tokens and got_trees == want_trees == by_levels_trees
    assert by_levels.stats.draft_forwards == by_levels.stats.rounds * 5  # the context pass and 4 levels a round
    assert got.stats.draft_forwards == got.stats.rounds
    assert C.tree_call(1, 4) in one.backend.graphs and C.tree_call(1, 8) not in one.backend.graphs
    assert got.stats.tau > 2.5  # a trained head: the chain's deep nodes are accepted, not only the first


@pytest.mark.parametrize("top_k, depth", [(4, 3), (4, 8), (1, 5), (2, 1)])
def test_tree_graph_equals_its_module_and_the_growers_choice(models, top_k, depth):
    """A graph cut to a depth (its full depth: 8) against the eager module traced for that depth, with a frontier
    choice that is decided by ties in generation order: two sequences in one call, one past shared by neither."""
    target, draft, art = models("mha", fc_bias=True)
    m = load_manifest(art)
    tgt = load_target(target, dtype=torch.float32, progress=False)
    head = load_draft_head(draft, tgt).head.eval()
    tree = TreeParams(top_k, depth, top_k)
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
    spec = m.graphs[C.tree_graph(top_k)].spec
    sess = _tree_session(art, m, top_k, depth)
    got = dict(zip(spec.output_names, sess.run(None, feed), strict=True))
    assert got[C.TREE_SCORES].shape == (b, tree.max_candidates)
    with torch.no_grad():
        want = module(*(torch.from_numpy(feed[k]) for k in spec.input_names))
    want = dict(zip(spec.output_names, (w.numpy() for w in want), strict=True))
    for k in (C.TREE_TOKENS, C.TREE_PARENTS, C.CONTEXT_TOPK_IDS):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for k in (C.TREE_SCORES, C.CONTEXT_TOPK_LOGPROBS, C.CONTEXT_HIDDEN, C.present_key(0)):
        np.testing.assert_allclose(got[k], want[k], atol=2e-4, rtol=1e-4, err_msg=k)
    # The second sequence's tree does not depend on rows it does not own (past rows 3.., its padding rows).
    feed2 = {k: v.copy() for k, v in feed.items()}
    feed2[C.past_key(0)][1, 3:] += 5.0
    feed2[C.DRAFT_FEATURES][1, 3:] += 5.0
    got2 = dict(zip(spec.output_names, sess.run(None, feed2), strict=True))
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
    d, defaults = m.draft, m.tree_defaults
    entry = m.graphs[C.tree_graph(defaults.top_k)]  # grown the artifact's --max-depth levels (contract 6)
    tree = TreeParams(defaults.top_k, entry.axes[C.TREE_DEPTH][1], defaults.total_tokens)
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
    """The tree graphs are standard operators (TopK, GatherND, Concat, Reshape with 0 entries): TensorRT-RTX builds
    one ahead of time, for an EAGLE-3 head with a draft vocabulary (its d2t map inside). The runtime's TensorRT backend
    still drafts with the step graph (docs/engines.md)."""
    from eagle_export.engines import builder as B
    from eagle_export.engines.libs import load_lib
    from eagle_export.engines.profiles import make_profile

    preset, kw = EAGLE3_MODELS["llama-d2t"]
    _, _, art = models(preset, **kw)
    m = load_manifest(art)
    name = C.tree_graph(m.tree_defaults.top_k)
    entry = m.graphs[name]
    profile = make_profile("round", entry, {C.BATCH: (1, 1, 1), C.NEW_TOKENS: (1, 4, 8), C.PAST_LEN: (0, 32, 64)})
    built = B.build_graph(load_lib("tensorrt-rtx"), art / entry.file, name, entry.spec, [profile])
    assert len(built.data) > 10_000 and [p.name for p in built.profiles] == ["round"]


def _grow_level_by_level(head, context_top_k: int, k: int, depth: int, embeds, feats, pos, mask, last: int, past):
    """One sequence's round as the step graph grows it: the head's own forward (``forward_hidden``) over the context
    rows, then one call per level, ``TreeGrower`` choosing each frontier on the host. Returns what the tree graph
    returns for this sequence (scores, tokens, parents, context top-k log-probs and ids, context hidden, presents)."""
    def step(emb, f, hidden, p, m, cache, width):
        h, *new = head.forward_hidden(emb, f, hidden, p, m, *cache)
        vals, ids = torch.topk(torch.log_softmax(head.logits(h), dim=-1), width, dim=-1)
        return vals[0], head.map_ids(ids)[0], h[0], new

    vals, ids, h, presents = step(embeds, feats, embeds[:, :0], pos, mask, past, context_top_k)
    grower = TreeGrower(TreeParams(k, depth, k))
    front = grower.add_root_children(vals[last].numpy(), ids[last].numpy())
    cache = [torch.cat((p, n), dim=1) for p, n in zip(past, presents, strict=True)]
    rows = h[last:last + 1]  # the hidden the level-1 nodes are fed from (parent row 0)
    for level in range(1, depth + 1):
        m = torch.cat((mask[:, last:last + 1].expand(1, k, -1), torch.from_numpy(front.tree_mask.copy())[None]), -1)
        p = pos[:, last:last + 1].expand(1, k) + level
        emb = head.embed_tokens(torch.from_numpy(front.tokens.copy()))[None]
        v, t, rows_next, new = step(emb, feats[:, :0], rows[torch.from_numpy(front.parent_rows.copy())][None], p, m,
                                    cache, k)
        cache = [torch.cat((c, n), dim=1) for c, n in zip(cache, new, strict=True)]
        front, rows = grower.add_children(v.numpy(), t.numpy()), rows_next
    return (grower.scores, grower.candidate_tokens, grower.candidate_parents, vals[last].numpy(), ids[last].numpy(),
            h[last].numpy(), [x[0].numpy() for x in presents])


# Heads of every reading the tree graph implements by hand (export/graphs/draft_tree.py mirrors their forward_hidden):
# EAGLE-1/2 with q/k/v biases, HASS norms and two layers on a GQA target; EAGLE-3 with fc_norm and norm_output,
# norm_before_fc and norm_before_residual with two layers, ModelOpt's first-layer norm, a sliding window.
HEADS = [
    pytest.param("qwen2", "eagle1", dict(qkv_bias=True), id="eagle1-qkvbias"),
    pytest.param("gqa", "eagle1", dict(hass=True, num_layers=2), id="eagle1-hass-2layers-gqa"),
    pytest.param("mha", "eagle3", dict(layout="specforge", fc_norm=True, norm_output=True, draft_vocab_size=32),
                 id="eagle3-fcnorm-normoutput"),
    pytest.param("gqa", "eagle3", dict(layout="speculators", norm_before_fc=True, num_layers=2), id="eagle3-2layers"),
    pytest.param("mha", "eagle3", dict(layout="modelopt", num_layers=2, draft_vocab_size=32), id="eagle3-modelopt"),
    pytest.param("gqa", "eagle3", dict(layout="speculators", layer_types=["sliding_attention"], sliding_window=4),
                 id="eagle3-window"),
]


@pytest.mark.parametrize("preset, variant, kw", HEADS)
@pytest.mark.parametrize("k, depth", [(1, 3), (3, 3)])
def test_tree_graph_grows_what_the_head_grows_level_by_level(tmp_path, preset, variant, kw, k, depth):
    """The tree graph's module, eagerly, against the head's own forward grown level by level with the host's
    TreeGrower (what the step graph does), for two sequences in one call with ragged context and padding rows: the
    same candidates (tokens, parents), the same scores, context row and presents, for every head reading."""
    torch.manual_seed(0)
    target = make_tiny_target(tmp_path / "t", preset, seed=0, with_tokenizer=False, vocab_size=48,
                              **({"num_hidden_layers": 8} if variant == "eagle3" and preset == "mha" else {}))
    make = make_tiny_draft if variant == "eagle1" else make_tiny_eagle3_draft
    draft = make(tmp_path / "d", target, seed=1, **kw)
    tgt = load_target(target, dtype=torch.float32, progress=False)
    head = load_draft_head(draft, tgt).head.eval()
    module = DraftTree(head, 4, k, depth).eval()
    rng = np.random.default_rng(5)
    b, n, past, dim = 2, 6, 9, head.fc.out_features
    feat_dim = head.fc.in_features if variant == "eagle3" else dim
    mask = np.zeros((b, n, past + n), dtype=bool)
    mask[0, :, :past] = True
    mask[1, :, :4] = True  # the second sequence owns 4 of the past rows and 4 context rows, then padding
    mask[:, :, past:] = np.tri(n, dtype=bool)
    mask[1, 4:, past:] = False
    mask[1, 4, past + 4] = mask[1, 5, past + 5] = True
    pos = np.stack([np.arange(past, past + n), np.r_[np.arange(4, 8), 8, 8]])
    last = [n - 1, 3]
    embeds = torch.from_numpy(rng.standard_normal((b, n, dim)).astype(np.float32))
    feats = torch.from_numpy(rng.standard_normal((b, n, feat_dim)).astype(np.float32))
    cache = [torch.from_numpy(rng.standard_normal((b, past, module.n_kv, module.hd)).astype(np.float32))
             for _ in range(2 * head.num_layers)]
    with torch.no_grad():
        got = module(embeds, feats, torch.from_numpy(pos), torch.from_numpy(mask), torch.tensor(last), *cache)
        for s, own_past, own_rows in ((0, past, n), (1, 4, 4)):
            rows = slice(0, own_rows)
            own = np.concatenate((mask[s:s + 1, rows, :own_past], mask[s:s + 1, rows, past:past + own_rows]), -1)
            want = _grow_level_by_level(
                head, 4, k, depth, embeds[s:s + 1, rows], feats[s:s + 1, rows], torch.from_numpy(pos[s:s + 1, rows]),
                torch.from_numpy(own), last[s], [c[s:s + 1, :own_past] for c in cache])
            np.testing.assert_array_equal(got[1][s].numpy(), want[1], err_msg="tokens")
            np.testing.assert_array_equal(got[2][s].numpy(), want[2], err_msg="parents")
            np.testing.assert_array_equal(got[4][s].numpy(), want[4], err_msg="context ids")
            np.testing.assert_allclose(got[0][s].numpy(), want[0], atol=2e-5, err_msg="scores")
            np.testing.assert_allclose(got[3][s].numpy(), want[3], atol=2e-5, err_msg="context log-probs")
            np.testing.assert_allclose(got[5][s].numpy(), want[5], atol=2e-5, err_msg="context hidden")
            for g, w in zip(got[6:], want[6], strict=True):
                np.testing.assert_allclose(g[s, rows].numpy(), w, atol=2e-5, err_msg="presents")


def _optimized_nodes(art, m, top_k: int, depth: int) -> list[str]:
    """Op types of a draft tree graph cut to ``depth`` as ONNX Runtime's CPU provider runs it (all optimisations,
    written back out)."""
    import tempfile

    import onnx
    import onnxruntime as ort

    from eagle_export.runtime.tree_graph import cut

    name, most = C.tree_graphs(m.graphs)[top_k]
    model = cut(onnx.load(str(art / m.graphs[name].file), load_external_data=False), top_k, depth, most)
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/optimized.onnx"
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.optimized_model_filepath = out
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(art))
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return [node.op_type for node in onnx.load(out, load_external_data=False).graph.node]


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_tree_graph_of_the_trained_fixture_is_small(trained, head):
    """The fixture's default trees (a depth-6 chain, a top_k 2 depth-4 tree) run as at most 250 nodes after ONNX
    Runtime's optimisation (690 and 626 before the static-shape graph), none of them shape arithmetic: a call costs
    few nodes per level (docs/runtime.md, "The draft tree graph")."""
    art = trained(head)
    m = load_manifest(art)
    ops = _optimized_nodes(art, m, m.tree_defaults.top_k, m.tree_defaults.depth)
    assert len(ops) <= 250, (len(ops), sorted(set(ops)))
    assert not {"Shape", "ConstantOfShape", "Range", "Expand"} & set(ops), sorted(set(ops))
