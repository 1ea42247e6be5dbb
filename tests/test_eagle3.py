"""EAGLE-3 specifics against independent formulations, not against the modules the graphs were traced from:

- the target's `features` are the inputs of decoder layers 2, L//2, L-3 (transformers' hidden_states[i]),
  concatenated; `--feature-layers` serves a head trained on another choice;
- the exported draft graph computes the reference's EAGLE-3 head, written out here from the checkpoint
  tensors in plain torch (float64): fc only on target features, the head's own output g fed back
  unchanged on the next step, q/k/v over [input_layernorm(embed), hidden_norm(h)], residual h, own
  norm + lm_head over the draft vocabulary, ids mapped by target_id = draft_id + d2t[draft_id].
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from model_table import EAGLE3_MODELS
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from eagle_export import contract as C
from eagle_export.manifest import load_manifest
from eagle_export.runtime.embedding import TokenEmbedding

TOL = 1e-4


def session(art, graph):
    m = load_manifest(art)
    return m, ort.InferenceSession(str(art / m.graphs[graph].file), providers=["CPUExecutionProvider"])


def draft_embeds(art, ids) -> np.ndarray:
    """The draft's input_embeds for ids, from the artifact's table, as the runtime gathers them."""
    return TokenEmbedding.open(art, load_manifest(art)).rows(ids).numpy()


def target_features(art, ids: list[int]) -> np.ndarray:
    """The exported target graph's `features` for a causal prefill of ids."""
    m, sess = session(art, C.TARGET_GRAPH)
    t, n = m.target, len(ids)
    empty = np.zeros((1, 0, t.kv_heads, t.head_dim), np.float32)
    feeds = {C.INPUT_IDS: np.array([ids]), C.POSITION_IDS: np.arange(n)[None],
             C.ATTENTION_MASK: np.tril(np.ones((n, n), bool))[None], C.LOGIT_INDICES: np.array([[n - 1]]),
             **{name: empty for name in C.past_names(t.num_layers)}}
    return sess.run([C.FEATURES], feeds)[0]


def hf_hidden_states(target_dir, ids: list[int]):
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states


def test_features_are_inputs_of_layers_2_half_and_minus_3(models):
    target, _, art = models("mha", eagle3=True, num_hidden_layers=8)
    m = load_manifest(art)
    assert m.variant == "eagle3" and m.target.feature_layers == [2, 4, 5]  # 2, 8 // 2, 8 - 3
    assert m.target.feature_dim == m.draft.feature_dim == 3 * 64
    ids = [5, 9, 17, 3, 44, 21, 30]
    hs = hf_hidden_states(target, ids)  # hs[i] = input of decoder layer i (hs[0] = embeddings)
    want = torch.cat([hs[2], hs[4], hs[5]], -1).numpy()
    got = target_features(art, ids)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < TOL


def test_feature_layers_option_serves_another_choice(models):
    """A head whose fc reads 2 layers, served with --feature-layers 1,0 (order kept: layer 1's input first)."""
    target, _, art = models("gqa", eagle3=True, num_feature_layers=2, feature_layers=(1, 0))
    m = load_manifest(art)
    assert m.target.feature_layers == [1, 0] and m.target.feature_dim == 128
    ids = [7, 3, 11, 40, 2]
    hs = hf_hidden_states(target, ids)
    got = target_features(art, ids)
    assert np.abs(got - torch.cat([hs[1], hs[0]], -1).numpy()).max() < TOL


# ---- the head, written out from the reference ---------------------------------------------------------


def rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta):
    """x [T, heads, hd] at integer positions pos [T] (default RoPE, rotate-half convention)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


class PrimerHead:
    """The EAGLE-3 head over a causal sequence of rows, each with its own h (fc(feature) or a fed-back g)."""

    def __init__(self, draft_dir, target_dir):
        self.cfg = json.loads((draft_dir / "config.json").read_text())
        self.w = {k: v.double() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        if "embed_tokens.weight" not in self.w:
            tw = load_file(str(target_dir / "model.safetensors"))
            self.w["embed_tokens.weight"] = tw["model.embed_tokens.weight"].double()
        vd = self.w["lm_head.weight"].shape[0]
        self.d2t = self.w["d2t"].long() if "d2t" in self.w else torch.zeros(vd, dtype=torch.long)

    def forward(self, tokens, hs, positions):
        c, w = self.cfg, self.w
        eps, theta = c["rms_norm_eps"], c["rope_theta"]
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // nh
        p = "midlayer."
        h = torch.stack(hs)
        x = torch.cat([rms(w["embed_tokens.weight"][tokens], w[p + "input_layernorm.weight"], eps),
                       rms(h, w[p + "hidden_norm.weight"], eps)], -1)
        T = len(tokens)
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd), positions, theta)
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd), positions, theta)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / hd**0.5
        scores = scores.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
        a = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * hd)
        g = h + a @ w[p + "self_attn.o_proj.weight"].T  # residual is h
        m = rms(g, w[p + "post_attention_layernorm.weight"], eps)
        g = g + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
                 ) @ w[p + "mlp.down_proj.weight"].T
        logp = torch.log_softmax(rms(g, w["norm.weight"], eps) @ w["lm_head.weight"].T, -1)
        return g, logp

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


@pytest.mark.parametrize("name", ["llama-d2t", "mistral-narrow"])
def test_draft_graph_computes_the_reference_head(models, name):
    """Context pass over target features, then three steps feeding the head's own output back (as a chain)."""
    preset, kw = EAGLE3_MODELS[name]
    target_dir, draft_dir, art = models(preset, **kw)
    m, sess = session(art, C.DRAFT_GRAPH)
    d, K = m.draft, m.tree_limits.max_top_k
    ref = PrimerHead(draft_dir, target_dir)
    rng = np.random.default_rng(3)
    n = 6
    feats = rng.standard_normal((n, d.feature_dim)).astype(np.float32)
    tokens = rng.integers(3, m.target.vocab_size, n).tolist()
    hs = list(torch.from_numpy(feats).double() @ ref.w["fc.weight"].T)  # fc only on target features
    past_k = past_v = np.zeros((1, 0, d.kv_heads, d.head_dim), np.float32)
    feed_f, feed_h = feats[None], np.zeros((1, 0, d.hidden_size), np.float32)
    ids = np.array([tokens])
    for step in range(4):
        pos = torch.arange(len(tokens))
        g, logp = ref.forward(torch.tensor(tokens), hs, pos)
        new = ids.shape[1]
        mask = np.ones((1, new, past_k.shape[1] + new), bool)
        mask[0, :, past_k.shape[1]:] = np.tril(np.ones((new, new), bool))
        vals, tids, hidden, k, v = sess.run(None, {
            C.INPUT_EMBEDS: draft_embeds(art, ids), C.DRAFT_FEATURES: feed_f, C.HIDDEN_IN: feed_h,
            C.POSITION_IDS: pos[-new:].numpy()[None], C.ATTENTION_MASK: mask,
            C.past_key(0): past_k, C.past_value(0): past_v})
        want_vals, want_draft_ids = torch.topk(logp[-new:], K, -1)
        assert np.abs(hidden[0] - g[-new:].numpy()).max() < TOL, f"step {step}: hidden"
        assert np.abs(vals[0] - want_vals.numpy()).max() < TOL, f"step {step}: top-k log-probs"
        np.testing.assert_array_equal(tids[0], ref.to_target(want_draft_ids).numpy(), f"step {step}: ids")
        # Next step: the best token (a target id), paired with the head's own output g, no fc.
        nxt = int(tids[0, -1, 0])
        tokens.append(nxt)
        hs.append(g[-1])
        past_k, past_v = np.concatenate([past_k, k], 1), np.concatenate([past_v, v], 1)
        ids, feed_f, feed_h = np.array([[nxt]]), np.zeros((1, 0, d.feature_dim), np.float32), hidden[:, -1:]
