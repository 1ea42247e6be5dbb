"""Every published EAGLE head format loads, detected from its files alone, and exports the document's math.

The heads are written by tools/testing/tiny_models from checkpoint-formats.md (not through the loader).
``DocHead`` below is each format's forward written in plain torch (float64) straight from the document: it reads
the raw files with the format's own key names and config keys, and shares no code with export/graphs/heads.py or the
loader. Per format and variant (tests/model_table.FORMAT_MODELS): the detected format and the feature layers (inputs of
target layers) in the manifest; the exported draft graph equals DocHead to 1e-4 over a context pass and three
fed-back steps; greedy EAGLE equals transformers' generate (8 prompts x 64 tokens); where the checkpoint names
its feature layers, the target graph's features are those layers and a one-layer shift of the ids changes the
draft's output. Math-changing config keys that are not implemented fail with a message naming key and file.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from cli_run import fail, ok
from model_table import FORMAT_MODELS
from safetensors.torch import load_file, save_file
from test_eagle3 import draft_embeds, hf_hidden_states, rms, rope, target_features
from test_lossless import check_lossless
from test_oracle import traced

from eagle_export import contract as C
from eagle_export.errors import CheckpointError
from eagle_export.export.checkpoint.loaders import load_draft_head, load_target
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.oracle import EagleOracle, compare_with_oracle
from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_eagle3_draft, make_tiny_target
from eagle_export.tree_params import TreeParams

TOL = 1e-4


def model(models, name):
    preset, kw, _, _ = FORMAT_MODELS[name]
    return models(preset, **kw)


# ---- each format's forward, from the document (rms and rope: test_eagle3's) ------------------------------


class DocHead:
    """A head as checkpoint-formats.md writes it, over a causal sequence of rows, from the raw files."""

    def __init__(self, draft_dir: Path, target_dir: Path, fmt: str):
        self.fmt = fmt
        cfg = json.loads((draft_dir / "config.json").read_text())
        self.cfg = cfg
        # speculators: the layer's hyper-parameters live in transformer_layer_config (section 4).
        self.lc = cfg["transformer_layer_config"] if fmt == "speculators-eagle3" else cfg
        self.w = {k: v.double() if v.is_floating_point() else v
                  for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        tw = load_file(str(target_dir / "model.safetensors"))
        self.target_embed = tw["model.embed_tokens.weight"].double()
        self.target_lm_head = tw.get("lm_head.weight", tw["model.embed_tokens.weight"]).double()
        self.eagle3 = fmt != "reference-eagle1"
        self.n_layers = 1 + len({k.split(".")[1] for k in self.w if k.startswith("layers.")} - {"0"})
        if fmt == "modelopt-eagle3" and any(k.startswith("midlayer.") for k in self.w):
            self.n_layers = len({k.split(".")[1] for k in self.w if k.startswith("midlayer.")
                                 and k.split(".")[1].isdigit()}) or 1
        ec = cfg.get("eagle_config") or {}

        def flag(key, default=False):
            return cfg.get(key, ec.get(key, default))

        # norm_before_residual: vLLM reads an absent key as true in a speculators config (section 4).
        self.norm_before_residual = flag("norm_before_residual", fmt == "speculators-eagle3")
        self.norm_output = flag("norm_output") or flag("return_hidden_post_norm")
        # ModelOpt's forward normalises the hidden stream with layers.0.input_layernorm before hidden_norm (section
        # 8b: what the writer trained; export/checkpoint/readings.py applies it by default).
        self.hidden_input_norm = fmt == "modelopt-eagle3"
        # speculators: the head's own sliding window (layer_types / sliding_window), in the layers it names.
        types = self.lc.get("layer_types") or []
        self.window = {i: self.lc["sliding_window"] for i, t in enumerate(types) if t == "sliding_attention"}

    def key(self, layer: int, name: str) -> str:
        """The format's tensor name for ``name`` of draft layer ``layer`` (sections 1-5)."""
        f = self.fmt
        if name == "pre_norm":  # pre-attention norm of layers >= 1
            name = "hidden_norm" if f == "modelopt-eagle3" else "input_layernorm"
        name += "" if name.endswith(("weight", "bias")) else ".weight"
        if f in ("reference-eagle3", "specforge-eagle3"):
            return f"midlayer.{name}"
        if f == "modelopt-eagle3" and any(k.startswith("midlayer.") for k in self.w):
            base = "midlayer." if self.n_layers == 1 else f"midlayer.{layer}."
        else:
            base = f"layers.{layer}."
        return base + name

    def embed(self, tokens):
        return self.w.get("embed_tokens.weight", self.target_embed)[tokens]

    def attention(self, layer, x, pos):
        c, w = self.lc, self.w
        nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // nh
        theta = c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
        T = x.shape[0]

        def proj(n, heads):
            y = x @ w[self.key(layer, f"self_attn.{n}_proj.weight")].T
            b = self.key(layer, f"self_attn.{n}_proj.bias")
            return (y + w[b] if b in w else y).view(T, heads, hd)

        q, k, v = rope(proj("q", nh), pos, theta), rope(proj("k", nkv), pos, theta), proj("v", nkv)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("thd,shd->hts", q, k) / hd**0.5
        s = s.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
        if layer in self.window:  # keys at distance >= window are not seen
            s = s.masked_fill((pos[:, None] - pos[None, :]) >= self.window[layer], float("-inf"))
        a = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, nh * hd)
        return a @ w[self.key(layer, "self_attn.o_proj.weight")].T

    def mlp_block(self, layer, a):
        w, eps = self.w, self.lc["rms_norm_eps"]
        m = rms(a, w[self.key(layer, "post_attention_layernorm")], eps)
        up = torch.nn.functional.silu(m @ w[self.key(layer, "mlp.gate_proj.weight")].T)
        up = up * (m @ w[self.key(layer, "mlp.up_proj.weight")].T)
        return a + up @ w[self.key(layer, "mlp.down_proj.weight")].T

    def later_layers(self, g, pos):
        eps = self.lc["rms_norm_eps"]
        for i in range(1, self.n_layers):  # plain pre-norm decoder layers
            g = g + self.attention(i, rms(g, self.w[self.key(i, "pre_norm")], eps), pos)
            g = self.mlp_block(i, g)
        return g

    def fc_in(self, feature):
        """EAGLE-3 z = W_fc F, after norm_before_fc (input_norm) or fc_norm (per T-wide chunk) when present."""
        w, eps = self.w, self.lc["rms_norm_eps"]
        if "input_norm.weight" in w:
            feature = rms(feature, w["input_norm.weight"], eps)
        if "fc_norm.0.weight" in w:
            chunks = feature.chunk(len([k for k in w if k.startswith("fc_norm.")]), -1)
            feature = torch.cat([rms(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(chunks)], -1)
        z = feature @ w["fc.weight"].T
        return z + w["fc.bias"] if "fc.bias" in w else z

    def forward(self, tokens, rows, pos):
        """rows: per position the EAGLE-1 feature f / EAGLE-3 z. Returns (state fed back, log-probs)."""
        w, eps = self.w, self.lc["rms_norm_eps"]
        e, h = self.embed(tokens), torch.stack(rows)
        if not self.eagle3:
            if "embed_layernorm.weight" in w:  # HASS
                e, h = rms(e, w["embed_layernorm.weight"], eps), rms(h, w["hidden_layernorm.weight"], eps)
            z = torch.cat([e, h], -1) @ w["fc.weight"].T + (w["fc.bias"] if "fc.bias" in w else 0)
            g = self.later_layers(self.mlp_block(0, z + self.attention(0, z, pos)), pos)  # layer 0: no input norm
            out = rms(g, w["lm_head_layernorm.weight"], eps) if "lm_head_layernorm.weight" in w else g
            return g, torch.log_softmax(out @ self.target_lm_head.T, -1)
        hin = rms(h, w[self.key(0, "input_layernorm")], eps) if self.hidden_input_norm else h
        hn = rms(hin, w[self.key(0, "hidden_norm")], eps)
        u = torch.cat([rms(e, w[self.key(0, "input_layernorm")], eps), hn], -1)
        r = hn if self.norm_before_residual else h
        g = self.later_layers(self.mlp_block(0, r + self.attention(0, u, pos)), pos)
        normed = rms(g, w["norm.weight"], eps)
        return (normed if self.norm_output else g), torch.log_softmax(normed @ w["lm_head.weight"].T, -1)

    def to_target(self, ids):
        return ids + self.w["d2t"][ids] if "d2t" in self.w else ids


def draft_session(art):
    m = load_manifest(art)
    return m, ort.InferenceSession(str(art / m.graphs[C.DRAFT_GRAPH].file), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", list(FORMAT_MODELS))
def test_detected_and_draft_graph_equals_the_document(models, name):
    """Format and feature layers in the manifest; a context pass then three fed-back steps equal DocHead."""
    _, _, fmt, layers = FORMAT_MODELS[name]
    target_dir, draft_dir, art = model(models, name)
    m, sess = draft_session(art)
    assert (m.draft.format, m.target.feature_layers) == (fmt, layers)
    d, K = m.draft, m.tree_limits.max_top_k
    ref = DocHead(draft_dir, target_dir, fmt)
    assert d.num_layers == ref.n_layers
    rng = np.random.default_rng(5)
    n = 6
    feats = rng.standard_normal((n, d.feature_dim)).astype(np.float32)
    tokens = rng.integers(3, m.target.vocab_size, n).tolist()
    f64 = torch.from_numpy(feats).double()
    rows = list(ref.fc_in(f64)) if ref.eagle3 else list(f64)
    past = [np.zeros((1, 0, d.kv_heads, d.head_dim), np.float32)] * (2 * d.num_layers)
    feed_f, feed_h, ids = feats[None], np.zeros((1, 0, d.hidden_size), np.float32), np.array([tokens])
    for step in range(4):
        pos = torch.arange(len(tokens))
        state, logp = ref.forward(torch.tensor(tokens), rows, pos)
        new = ids.shape[1]
        mask = np.ones((1, new, past[0].shape[1] + new), bool)
        mask[0, :, past[0].shape[1]:] = np.tril(np.ones((new, new), bool))
        vals, tids, hidden, *presents = sess.run(None, {
            C.INPUT_EMBEDS: draft_embeds(art, ids), C.DRAFT_FEATURES: feed_f, C.HIDDEN_IN: feed_h,
            C.POSITION_IDS: pos[-new:].numpy()[None], C.ATTENTION_MASK: mask,
            **dict(zip(C.past_names(d.num_layers), past, strict=True))})
        want_vals, want_ids = torch.topk(logp[-new:], K, -1)
        assert np.abs(hidden[0] - state[-new:].numpy()).max() < TOL, f"step {step}: hidden"
        assert np.abs(vals[0] - want_vals.numpy()).max() < TOL, f"step {step}: top-k log-probs"
        np.testing.assert_array_equal(tids[0], ref.to_target(want_ids).numpy(), f"step {step}: ids")
        nxt = int(tids[0, -1, 0])  # next step: the best token with the head's own fed-back state
        tokens.append(nxt)
        rows.append(state[-1])
        past = [np.concatenate([p, q], 1) for p, q in zip(past, presents, strict=True)]
        ids, feed_f, feed_h = np.array([[nxt]]), np.zeros((1, 0, d.feature_dim), np.float32), hidden[:, -1:]


@pytest.mark.parametrize("name", list(FORMAT_MODELS))
def test_greedy_lossless_per_format(models, name):
    preset, kw, _, _ = FORMAT_MODELS[name]
    _, accepted = check_lossless(models, preset, kw, (0,), count=8)  # a pruned tree (top_k 4, depth 3, 10 nodes)
    assert accepted > 15  # 27-47 seen: multi-token commits are exercised, not only rejections


@pytest.mark.parametrize("name", list(FORMAT_MODELS))
def test_runtime_equals_oracle_per_format(models, name):
    """validate's round check holds for every format: the PyTorch oracle follows each head option too."""
    target, draft, art = model(models, name)
    rt = EagleRuntime.open(art, threads=1)
    oracle = EagleOracle.load(target, draft)
    rng = np.random.default_rng(11)
    for _ in range(2):
        prompt = rng.integers(3, rt.manifest.target.vocab_size, int(rng.integers(2, 16))).tolist()
        tree = TreeParams(3, 2, 8)
        res, rounds = traced(rt, prompt, 12, tree)
        cmp = compare_with_oracle(res.tokens, rounds, oracle.generate(prompt, 12, tree, rt.manifest.max_seq_len),
                                  1e-4)
        assert cmp.status in ("match", "tie"), f"{name}: {cmp.detail}"


# ---- feature layers --------------------------------------------------------------------------------------

ID_FORMATS = ["specforge-fcnorm-normout", "speculators-2layers", "modelopt-midlayer"]


def shifted(models, name, tmp_path) -> Path:
    """The same head with every feature id in its config one layer later; exported to tmp_path/art."""
    target, draft, _ = model(models, name)
    copy = Path(shutil.copytree(draft, tmp_path / "draft"))
    cfg = json.loads((copy / "config.json").read_text())
    node = cfg if "eagle_aux_hidden_state_layer_ids" in cfg else cfg["eagle_config"]
    node["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in node["eagle_aux_hidden_state_layer_ids"]]
    (copy / "config.json").write_text(json.dumps(cfg))
    ok("export", "--target", target, "--draft", copy, "--out", tmp_path / "art", "--max-seq-len", 256, "--quiet")
    return tmp_path / "art"


@pytest.mark.parametrize("name", ID_FORMATS)
def test_checkpoint_feature_layers_are_used(models, name, tmp_path):
    """The target graph's features are HF hidden_states at the converted ids; shifting the ids by one layer
    shifts the manifest's layers and changes the draft's top-k for the same prompt."""
    target, _, art = model(models, name)
    layers = FORMAT_MODELS[name][3]
    prompt = [5, 9, 17, 3, 44, 21, 30]
    hs = hf_hidden_states(target, prompt)
    feats = target_features(art, prompt)
    assert np.abs(feats - torch.cat([hs[i] for i in layers], -1).numpy()).max() < TOL
    art2 = shifted(models, name, tmp_path)
    assert load_manifest(art2).target.feature_layers == [i + 1 for i in layers]
    feats2 = target_features(art2, prompt)

    def draft_top(a, f):
        m, sess = draft_session(a)
        d, n = m.draft, len(prompt)
        empty = np.zeros((1, 0, d.kv_heads, d.head_dim), np.float32)
        out = sess.run(None, {C.INPUT_EMBEDS: draft_embeds(a, [prompt[1:] + [7]]), C.DRAFT_FEATURES: f,
                              C.HIDDEN_IN: np.zeros((1, 0, d.hidden_size), np.float32),
                              C.POSITION_IDS: np.arange(n)[None],
                              C.ATTENTION_MASK: np.tril(np.ones((n, n), bool))[None],
                              **{k: empty for k in C.past_names(d.num_layers)}})
        return out[0]

    assert not np.allclose(draft_top(art, feats), draft_top(art2, feats2), atol=1e-3)


def test_six_layer_target_feature_layers_flag_with_repeats(models, tmp_path):
    """The reference head on a 6-layer target exports with no flags as 2, 3, 3 (see the table: lossless), and
    --feature-layers 2,3,3 is accepted and gives the same artifact's features."""
    target, draft, art = model(models, "reference-eagle3-6layers")
    ok("export", "--target", target, "--draft", draft, "--out", tmp_path / "a", "--max-seq-len", 256,
       "--feature-layers", "2,3,3", "--quiet")
    m = load_manifest(tmp_path / "a")
    assert m.target.feature_layers == [2, 3, 3] and m.draft.feature_layers_source == "--feature-layers"
    prompt = [4, 8, 15, 16, 23, 42]
    hs = hf_hidden_states(target, prompt)
    assert np.abs(target_features(tmp_path / "a", prompt) - torch.cat([hs[2], hs[3], hs[3]], -1).numpy()).max() < TOL
    fail("export", "--target", target, "--draft", draft, "--out", tmp_path / "b", "--feature-layers", "2,3,6",
         "--quiet", expect=("--feature-layers [2, 3, 6]", "[0, 6)"))


def test_checkpoint_feature_layer_out_of_range(models, tmp_path):
    target, draft, _ = model(models, "speculators-2layers")
    copy = Path(shutil.copytree(draft, tmp_path / "draft"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 8]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"eagle_aux_hidden_state_layer_ids \[1, 3, 8\].*\[0, 8\)"):
        load_draft_head(copy, load_target(target))


# ---- --max-seq-len default -------------------------------------------------------------------------------


def test_max_seq_len_defaults_to_the_target_limit(models, caplog):
    # The tiny heads copy the target's max_position_embeddings: a 1024-position target and head give capacity
    # 1024 - 8 (--max-depth), so the draft's positions (up to capacity + depth) stay in the head's range and the
    # default export does not warn (it used to: "positions reach 1032"); no flag needed either way.
    with caplog.at_level(logging.WARNING, logger="eagle_export"):
        _, _, art = models("mha", max_seq_len=None, max_position_embeddings=1024)
    assert load_manifest(art).max_seq_len == 1024 - 8
    assert "positions reach" not in caplog.text
    _, _, art = models("mha", max_seq_len=None, max_position_embeddings=4096)
    assert load_manifest(art).max_seq_len == 2048  # min(2048, 4096, 4096 - 8)


# ---- math-changing keys that are not implemented: one clear error naming the key and the file ------------


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A tiny target plus one head per layout, written once; tests copy and edit them."""
    root = tmp_path_factory.mktemp("heads")
    target = make_tiny_target(root / "t", "mha", with_tokenizer=False, vocab_size=48, num_hidden_layers=8)
    out = {"target": target, "loaded": load_target(target)}
    out["eagle1"] = make_tiny_draft(root / "eagle1", target, seed=1)
    for layout in ("reference", "specforge", "speculators", "modelopt"):
        out[layout] = make_tiny_eagle3_draft(root / layout, target, seed=1, layout=layout)
    return out


def edited(heads, layout, tmp_path, cfg_edit=None, weights_edit=None) -> Path:
    d = Path(shutil.copytree(heads[layout], tmp_path / layout))
    if cfg_edit:
        cfg = json.loads((d / "config.json").read_text())
        cfg_edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if weights_edit:
        w = load_file(str(d / "model.safetensors"))
        weights_edit(w)
        save_file(w, str(d / "model.safetensors"))
    return d


def top(key, value):
    return lambda c: c.__setitem__(key, value)


def in_eagle_config(key, value):
    return lambda c: c["eagle_config"].__setitem__(key, value)


def drop(*keys):
    return lambda w: [w.pop(k) for k in keys]


# (layout, config edit, weights edit, fragments the message must hold). Every math-changing key that
# checkpoint-formats.md names and the tool does not implement, plus option keys that disagree with the tensors.
REFUSED = [
    ("modelopt", top("quantization_config", {"quant_algo": "FP8"}), None, ("quantization_config",)),
    ("modelopt", top("kv_lora_rank", 512), None, ("kv_lora_rank", "MLA")),
    ("modelopt", in_eagle_config("eh_proj_before_attn", True), None, ("eagle_config.eh_proj_before_attn",)),
    ("modelopt", in_eagle_config("use_mtp_layernorm", True), None, ("eagle_config.use_mtp_layernorm",)),
    ("modelopt", in_eagle_config("parallel_draft_step", 3), None, ("eagle_config.parallel_draft_step",)),
    ("modelopt", in_eagle_config("use_aux_hidden_state", False), None, ("eagle_config.use_aux_hidden_state",)),
    ("modelopt", in_eagle_config("next_layer_regular", False), None, ("eagle_config.next_layer_regular",)),
    ("modelopt", in_eagle_config("use_last_layernorm", False), None, ("eagle_config.use_last_layernorm",)),
    ("modelopt", in_eagle_config("use_input_layernorm_in_first_layer", False), None,
     ("use_input_layernorm_in_first_layer",)),
    ("modelopt", in_eagle_config("norm_before_residual", True), None, ("norm_before_residual", "TensorRT-LLM")),
    ("reference", top("attention_bias", True), None, ("attention_bias",)),
    ("reference", top("mlp_bias", True), None, ("mlp_bias",)),
    ("reference", top("pretraining_tp", 2), None, ("pretraining_tp",)),
    ("specforge", top("norm_before_fc", True), None, ("norm_before_fc is True", "input_norm.weight")),
    ("specforge", top("fc_norm", True), None, ("fc_norm is True", "fc_norm.*")),
    ("specforge", lambda c: c.update(fc_norm=True, norm_before_fc=True), None, ("mutually exclusive",)),
    ("specforge", top("norm_output", "yes"), None, ("norm_output", "true or false")),
    ("speculators", top("speculators_model_type", "eagle"), None, ("speculators_model_type 'eagle'",)),
    ("speculators", lambda c: c["transformer_layer_config"].update(model_type="mixtral"), None,
     ("transformer_layer_config model_type 'mixtral'",)),
    ("speculators", lambda c: c["transformer_layer_config"].update(attention_bias=True), None,
     ("transformer_layer_config", "attention_bias")),
    ("reference", None, drop("lm_head.weight"), ("no lm_head.weight",)),
    ("eagle1", top("bias", False), None, ('"bias": false', "fc.bias")),
    ("eagle1", lambda c: c.pop("bias"), drop("fc.bias"), ('no "bias" key', "lack fc.bias")),
    ("eagle1", top("qkv_bias", True), None, ("qkv_bias is True", "q/k/v biases")),
    ("eagle1", top("num_hidden_layers", 2), None, ("num_hidden_layers=2", "1 layer(s)")),
]


@pytest.mark.parametrize("layout, cfg_edit, weights_edit, fragments", REFUSED,
                         ids=[f"{r[0]}-{r[3][0][:40]}" for r in REFUSED])
def test_unimplemented_or_inconsistent_key_is_refused(heads, tmp_path, layout, cfg_edit, weights_edit, fragments):
    d = edited(heads, layout, tmp_path, cfg_edit, weights_edit)
    with pytest.raises(CheckpointError) as info:
        load_draft_head(d, heads["loaded"])
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    if cfg_edit is not None:
        assert str(d / "config.json") in msg or "model.safetensors" in msg, msg


# Config keys the document names that are read (not refused): (layout, edit, check on the LoadedDraft).
READ = [
    # The reference ignores num_hidden_layers (yuhuili's Vicuna-13B head declares 40): one midlayer.
    ("reference", top("num_hidden_layers", 40), None, lambda d: d.options.num_layers == 1),
    # TensorRT-LLM's spelling of norm_output.
    ("modelopt", in_eagle_config("return_hidden_post_norm", True), None, lambda d: d.options.norm_output),
    # speculators: an explicit false overrides vLLM's default of true.
    ("speculators", top("norm_before_residual", False), None, lambda d: not d.options.norm_before_residual),
    ("speculators", None, None, lambda d: d.options.norm_before_residual),
    # Old converted configs spell the EAGLE-1 fc bias eagle_fc_bias.
    ("eagle1", lambda c: (c.pop("bias"), c.update(eagle_fc_bias=False)), drop("fc.bias"),
     lambda d: not d.options.fc_bias and d.head.fc.bias is None),
]


@pytest.mark.parametrize("layout, cfg_edit, weights_edit, check", READ)
def test_config_keys_that_are_read(heads, tmp_path, layout, cfg_edit, weights_edit, check):
    assert check(load_draft_head(edited(heads, layout, tmp_path, cfg_edit, weights_edit), heads["loaded"]))


def test_tie_word_embeddings_is_reported_not_followed(heads, tmp_path, caplog):
    d = edited(heads, "specforge", tmp_path, top("tie_word_embeddings", True))
    with caplog.at_level("WARNING", logger="eagle_export"):
        head = load_draft_head(d, heads["loaded"]).head
    assert "tie_word_embeddings" in caplog.text and str(d / "config.json") in caplog.text
    assert torch.equal(head.lm_head.weight, load_file(str(d / "model.safetensors"))["lm_head.weight"])


def test_legacy_speculators_eagle1_is_refused(heads, tmp_path):
    d = edited(heads, "eagle1", tmp_path, weights_edit=lambda w: w.__setitem__("fusion_fc.weight", w.pop("fc.weight")))
    with pytest.raises(CheckpointError, match="legacy speculators EAGLE-1 head"):
        load_draft_head(d, heads["loaded"])


def test_unknown_tensor_names_key_and_file(heads, tmp_path):
    d = edited(heads, "speculators", tmp_path,
               weights_edit=lambda w: w.__setitem__("layers.0.self_attn.rotary_scale", torch.ones(2)))
    with pytest.raises(CheckpointError, match=r"model.safetensors has keys .*speculators-eagle3.*rotary_scale"):
        load_draft_head(d, heads["loaded"])


def test_every_layout_is_told_apart_from_its_files(heads):
    got = {layout: load_draft_head(heads[layout], heads["loaded"]).format
           for layout in ("eagle1", "reference", "specforge", "speculators", "modelopt")}
    assert got == {"eagle1": "reference-eagle1", "reference": "reference-eagle3", "specforge": "specforge-eagle3",
                   "speculators": "speculators-eagle3", "modelopt": "modelopt-eagle3"}
