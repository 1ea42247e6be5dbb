"""The fixture recipe's training-time test matches the exported draft's own forward, step by step.

If the unrolled training forward (tools/recipe/train_heads.ttt_forward) attended to other keys, used other positions or
fed other inputs than the draft step graph does at inference, the heads would be trained for a different model
than the one that runs; these tests pin it to Eagle1Head/Eagle3Head.forward_hidden on random tiny heads.
"""

from __future__ import annotations

import pytest
import torch

from eagle_export.export.checkpoint.loaders import default_feature_layers, load_draft_head, load_target
from eagle_export.tools.recipe.train_heads import _draft_vocab, chain_figures, ttt_forward
from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_eagle3_draft, make_tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("ttt") / "target"
    make_tiny_target(d, "gqa", seed=0, num_hidden_layers=8)
    return d


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_unrolled_steps_equal_the_inference_forward(target, tmp_path, variant):
    if variant == "eagle1":
        make_tiny_draft(tmp_path / "d", target, seed=1)
    else:
        make_tiny_eagle3_draft(tmp_path / "d", target, seed=1, draft_vocab_size=100)
    t = load_target(target, progress=False)
    head = load_draft_head(tmp_path / "d", t).head
    gen = torch.Generator().manual_seed(0)
    B, N, unroll = 2, 12, 3
    n = N - unroll
    ids = torch.randint(3, t.config.vocab_size, (B, N), generator=gen)
    fdim = t.config.hidden_size * (1 if variant == "eagle1" else len(default_feature_layers(8)))
    feats = torch.randn(B, N, fdim, generator=gen)
    with torch.no_grad():
        outs = ttt_forward(head, variant, ids, feats, unroll)
        H = outs[0].shape[-1]
        attn = (head.layers[0] if variant == "eagle1" else head.midlayer).self_attn
        kv, hd = attn.k_proj.out_features // attn.head_dim, attn.head_dim
        empty_k = torch.zeros(B, 0, kv, hd)
        # Step 0 = the context pass: rows (feature_p, token_{p+1}) at positions p, causal.
        h0, k0, v0 = head.forward_hidden(head.embed_tokens(ids[:, 1:n + 1]), feats[:, :n], torch.zeros(B, 0, H),
                                         torch.arange(n).expand(B, n), torch.ones(n, n, dtype=torch.bool).tril()
                                         .expand(B, n, n), empty_k, empty_k)
        torch.testing.assert_close(outs[0], h0, rtol=1e-4, atol=1e-5)
        # Steps 1..: a tree path at anchor p: context keys 0..p, then the path's own rows, each at position p+s.
        for p in (0, 4, n - 1):
            pk, pv, hid = k0[:, :p + 1], v0[:, :p + 1], outs[0][:, p:p + 1]
            for s in range(1, unroll):
                h, k, v = head.forward_hidden(head.embed_tokens(ids[:, p + 1 + s:p + 2 + s]), feats[:, :0], hid,
                                              torch.full((B, 1), p + s), torch.ones(B, 1, pk.shape[1] + 1,
                                                                                    dtype=torch.bool), pk, pv)
                torch.testing.assert_close(outs[s][:, p:p + 1], h, rtol=1e-4, atol=1e-5)
                pk, pv, hid = torch.cat((pk, k), 1), torch.cat((pv, v), 1), h


def test_chain_figures_count_the_leading_run():
    # two anchors: steps agree (T, T, F) and (F, T, T): leading runs 2 and 0
    agree = [torch.tensor([[True, False]]), torch.tensor([[True, True]]), torch.tensor([[False, True]])]
    fig = chain_figures(agree, gen_from=torch.tensor([0]))
    assert fig["mean_accepted_chain"] == 1.0 and fig["chain_tau"] == 2.0
    assert fig["top1_agreement_per_step"] == [0.5, 1.0, 0.5]


def test_draft_vocab_is_the_most_frequent_ids_ascending():
    seqs = torch.tensor([[5, 5, 5, 9, 9, 1, 7, 7, 7, 7]])
    assert _draft_vocab(seqs, 12, 3).tolist() == [5, 7, 9]
