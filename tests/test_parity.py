"""ONNX Runtime outputs of both graphs equal the PyTorch modules they were traced from (fp32, 1e-4), and the target
graph equals transformers' own model (not our modules) on a grouped-query config, prefill and tree verify.

Non-causal tree masks, cache length 0 and > 0, batch 1 and 2, several new-token counts; draft rows fed
from target features only, from fed-back hiddens only (zero-size `features`), and both. EAGLE-1/2 heads
on Llama targets, EAGLE-3 heads (3-layer features, d2t, a narrower head) on Llama, Qwen2, Qwen3, Mistral.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from model_table import EAGLE3_MODELS

from eagle_export import contract as C
from eagle_export.export.checkpoint.loaders import load_draft_head, load_target
from eagle_export.export.graphs.heads import DraftStep
from eagle_export.export.graphs.target import TargetVerify
from eagle_export.manifest import load_manifest
from eagle_export.runtime.embedding import TokenEmbedding

TOL = 1e-4
# (batch, draft rows from features, draft rows from hidden_in, past); the target gets new = both.
SHAPES = [(1, 5, 0, 0), (2, 0, 4, 0), (1, 3, 0, 9), (2, 4, 3, 6), (1, 0, 1, 12), (2, 1, 0, 3), (1, 0, 4, 7)]


def random_mask(rng, b, t, p):
    """Random tree-like mask: every past column visible or not per row (padding), new block random + diagonal."""
    mask = rng.random((b, t, p + t)) < 0.6
    mask[:, :, p:] |= np.eye(t, dtype=bool)
    return mask


def sessions(art):
    m = load_manifest(art)
    return m, {name: ort.InferenceSession(str(art / g.file), providers=["CPUExecutionProvider"])
               for name, g in m.graphs.items()}


def max_errors(got, want, names):
    return {n: float(np.abs(g - w.numpy()).max()) if g.size else 0.0 for n, g, w in zip(names, got, want, strict=True)}


@pytest.mark.parametrize("preset, kw", [
    *[pytest.param(p, {}, id=p) for p in ("gqa", "headdim", "llama3rope")],
    *[pytest.param(p, kw, id=name) for name, (p, kw) in EAGLE3_MODELS.items()],
])
def test_graphs_match_pytorch(models, preset, kw):
    target_dir, draft_dir, art = models(preset, **kw)
    m, sess = sessions(art)
    t = load_target(target_dir)
    draft = load_draft_head(draft_dir, t, m.target.feature_layers if m.variant == "eagle3" else None)
    assert draft.variant == m.variant == ("eagle3" if kw.get("eagle3") else "eagle1")
    tv = TargetVerify(t.model, m.target.feature_layers).eval()
    ds = DraftStep(draft.head, m.tree_limits.max_top_k).eval()
    tspec, dspec = m.graphs[C.TARGET_GRAPH].spec, m.graphs[C.DRAFT_GRAPH].spec
    ti, di = m.target, m.draft
    table = TokenEmbedding.open(art, m)
    rng = np.random.default_rng(0)
    for b, nf, nh, p in SHAPES:
        n = nf + nh
        ids = rng.integers(0, ti.vocab_size, (b, n))
        pos = p + np.tile(np.arange(n), (b, 1)) + rng.integers(0, 3, (b, 1))
        mask = random_mask(rng, b, n, p)
        rows = np.stack([rng.permutation(n)[: max(1, n - 1)] for _ in range(b)])
        past = [rng.standard_normal((b, p, ti.kv_heads, ti.head_dim)).astype(np.float32)
                for _ in range(2 * ti.num_layers)]
        feeds = dict(zip(tspec.input_names, [ids, pos, mask, rows, *past], strict=True))
        got = sess[C.TARGET_GRAPH].run(tspec.output_names, feeds)
        with torch.no_grad():
            want = tv(*[torch.from_numpy(np.asarray(x)) for x in feeds.values()])
        errs = max_errors(got, want, tspec.output_names)
        assert max(errs.values()) < TOL, f"target b={b} new={n} past={p}: {errs}"
        assert got[0].shape == (b, rows.shape[1], ti.vocab_size)
        assert got[1].shape == (b, n, ti.feature_dim)

        feats = rng.standard_normal((b, nf, di.feature_dim)).astype(np.float32)
        hidden_in = rng.standard_normal((b, nh, di.hidden_size)).astype(np.float32)
        dpast = [rng.standard_normal((b, p, di.kv_heads, di.head_dim)).astype(np.float32) for _ in range(2)]
        # The graph gets its embedding rows as the runtime gathers them, from the artifact's one table; the module
        # embeds the ids with the head's own PyTorch embedding: a wrong table, offset or layout shows here.
        feeds = dict(zip(dspec.input_names, [table.rows(ids).numpy(), feats, hidden_in, pos, mask, *dpast],
                         strict=True))
        got = sess[C.DRAFT_GRAPH].run(dspec.output_names, feeds)
        with torch.no_grad():
            rest = [torch.from_numpy(np.asarray(x)) for x in list(feeds.values())[1:]]
            want = ds(ds.embed(torch.from_numpy(ids)), *rest)
        errs = max_errors(got, want, dspec.output_names)
        # Top-k ids may legitimately swap only where log-probs tie; compare values, and ids where not tied.
        ids_err = errs.pop(C.TOPK_IDS)
        assert max(errs.values()) < TOL, f"draft b={b} rows={nf}+{nh} past={p}: {errs}"
        if ids_err:  # an id may differ only where two log-probs tie
            vals = want[0].numpy()
            for bi, ti_, ki in np.argwhere(got[1] != want[1].numpy()):
                row = vals[bi, ti_]
                assert np.sum(np.abs(row - row[ki]) < TOL) > 1, f"top-k id differs without a tie at {bi, ti_, ki}"
        # Ids are target-vocabulary ids, and only those the draft vocabulary maps to.
        assert got[1].min() >= 0 and got[1].max() < ti.vocab_size
        if draft.head.variant == "eagle3" and draft.head.draft_to_target is not None:
            assert np.isin(got[1], draft.head.draft_to_target.numpy()).all()


def test_masked_cache_rows_do_not_leak(models):
    """Columns masked off (padding, other branches) have no effect whatever the cache holds there."""
    _, _, art = models("gqa")
    m, sess = sessions(art)
    ti = m.target
    spec = m.graphs[C.TARGET_GRAPH].spec
    rng = np.random.default_rng(1)
    b, n, p = 1, 4, 8
    mask = random_mask(rng, b, n, p)
    mask[:, :, 5:p] = False  # rows 5..7 of the cache are garbage
    base = [rng.standard_normal((b, p, ti.kv_heads, ti.head_dim)).astype(np.float32)
            for _ in range(2 * ti.num_layers)]
    noisy = [x.copy() for x in base]
    for x in noisy:
        x[:, 5:] = 1e4
    inputs = [rng.integers(0, ti.vocab_size, (b, n)), np.tile(np.arange(p, p + n), (b, 1)), mask,
              np.tile(np.arange(n), (b, 1))]
    a = sess[C.TARGET_GRAPH].run(None, dict(zip(spec.input_names, [*inputs, *base], strict=True)))
    c = sess[C.TARGET_GRAPH].run(None, dict(zip(spec.input_names, [*inputs, *noisy], strict=True)))
    for x, y in zip(a, c, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_fp16_export_runs_and_stays_close(models):
    """An fp16 artifact exports, declares fp16 IO, runs on ONNX Runtime CPU, and tracks fp32 loosely."""
    _, _, art16 = models("mha", dtype="fp16")
    _, _, art32 = models("mha")
    m16, s16 = sessions(art16)
    _, s32 = sessions(art32)
    spec = m16.graphs[C.TARGET_GRAPH].spec
    assert {t.name: t.dtype for t in spec.inputs}[C.past_key(0)] == "float16"
    ti = m16.target
    rng = np.random.default_rng(2)
    b, n, p = 1, 6, 0
    ids = rng.integers(0, ti.vocab_size, (b, n))
    pos = np.arange(n)[None]
    mask = np.tril(np.ones((n, n), dtype=bool))[None]
    rows = np.arange(n)[None]
    past = [np.zeros((b, p, ti.kv_heads, ti.head_dim), np.float16) for _ in range(2 * ti.num_layers)]
    l16 = s16[C.TARGET_GRAPH].run([C.LOGITS], dict(zip(spec.input_names, [ids, pos, mask, rows, *past],
                                                        strict=True)))[0]
    l32 = s32[C.TARGET_GRAPH].run([C.LOGITS], dict(zip(spec.input_names, [ids, pos, mask, rows,
                                                                          *[x.astype(np.float32) for x in past]],
                                                        strict=True)))[0]
    assert l16.dtype == np.float32
    assert np.abs(l16 - l32).max() < 0.05 * max(1.0, np.abs(l32).max())


def test_target_graph_equals_transformers_on_gqa(models):
    """The target graph against transformers' LlamaForCausalLM itself, where our modules could share a bug with the
    graph traced from them: 8 query heads over 2 KV heads (groups of 4). A prefill's logits and features equal
    transformers' on the prompt; then a tree verify over the prefill's own cache: every node's logits and features
    equal transformers' last row over the prompt + that node's root-to-node path (tree mask and depth positions)."""
    from transformers import AutoModelForCausalLM

    target_dir, _, art = models("gqa")
    m, sess = sessions(art)
    ti, spec = m.target, m.graphs[C.TARGET_GRAPH].spec
    assert ti.num_heads // ti.kv_heads == 4 and m.target.feature_layers is None  # grouped; features: final norm
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(4)

    def run(ids, pos, mask, past):
        n = len(ids)
        feeds = {C.INPUT_IDS: np.array([ids]), C.POSITION_IDS: np.array([pos]), C.ATTENTION_MASK: mask[None],
                 C.LOGIT_INDICES: np.arange(n)[None], **dict(zip(C.past_names(ti.num_layers), past, strict=True))}
        return dict(zip(spec.output_names, sess[C.TARGET_GRAPH].run(spec.output_names, feeds), strict=True))

    def hf_last(ids):
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True)
        return out.logits[0].numpy(), out.hidden_states[-1][0].numpy()

    prompt = rng.integers(0, ti.vocab_size, 9).tolist()
    empty = [np.zeros((1, 0, ti.kv_heads, ti.head_dim), np.float32)] * (2 * ti.num_layers)
    pre = run(prompt, list(range(9)), np.tri(9, dtype=bool), empty)
    logits, hidden = hf_last(prompt)
    np.testing.assert_allclose(pre[C.LOGITS][0], logits, atol=TOL, rtol=0)
    np.testing.assert_allclose(pre[C.FEATURES][0], hidden, atol=TOL, rtol=0)

    parents = [-1, 0, 0, 1, 1, 2, 3]  # a 7-node tree, depths 0, 1, 1, 2, 2, 2, 3
    tokens = rng.integers(0, ti.vocab_size, len(parents)).tolist()
    paths = []
    for j, par in enumerate(parents):
        paths.append((paths[par] if par >= 0 else []) + [j])
    mask = np.zeros((len(parents), 9 + len(parents)), dtype=bool)
    mask[:, :9] = True
    for j, path in enumerate(paths):
        mask[j, [9 + a for a in path]] = True
    past = [pre[n] for n in C.present_names(ti.num_layers)]
    tree = run(tokens, [9 + len(p) - 1 for p in paths], mask, past)
    for j, path in enumerate(paths):
        logits, hidden = hf_last(prompt + [tokens[a] for a in path])
        np.testing.assert_allclose(tree[C.LOGITS][0, j], logits[-1], atol=TOL, rtol=0, err_msg=f"node {j}")
        np.testing.assert_allclose(tree[C.FEATURES][0, j], hidden[-1], atol=TOL, rtol=0, err_msg=f"node {j}")
