"""Stand-ins for the writer libraries that do not install beside this package (speculators, SpecForge 0.2.0 and
eagle-llm 1.2.1 pin other torch/transformers versions; the last two run here only installed with --no-deps, which CI
does not do): each one's draft forward in plain float64 torch, written from
what the library's own code does (shared/docs/checkpoint-formats.md section 8b), reading the raw files with the
format's key names. They share no code with export/ and enforce the contract ``validate --against-library`` relies
on (``tools/commands/against_library.LibraryForward``): rows of target features then fed-back states, any mask.

- ``speculators``: the layer config's ``layer_types`` / ``sliding_window`` really restrict attention;
  ``norm_before_residual`` absent = true.
- ``specforge-0.2``: ``norm_output`` true = feed g back, logits lm_head(norm(g)); false = logits lm_head(g).
- ``eagle-llm-1.2``: EAGLE-1/2 head, rotary base 10000 whatever ``rope_theta`` says.

(nvidia-modelopt installs beside this package: its heads are checked against the library itself.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_eagle3 import rms, rope


class WriterForward:
    """One writer library's forward (see the module docstring), as ``against_library.LibraryForward``."""

    def __init__(self, draft_dir: Path, target_dir: Path, writer: str):
        self.library, self.version, self.writer = f"{writer} (stand-in)", "", writer
        cfg = json.loads((Path(draft_dir) / "config.json").read_text())
        self.cfg = cfg
        self.lc = cfg.get("transformer_layer_config", cfg)
        self.w = {k: v.double() if v.is_floating_point() else v
                  for k, v in load_file(str(Path(draft_dir) / "model.safetensors")).items()}
        tw = load_file(str(Path(target_dir) / "model.safetensors"))
        self.target_lm_head = tw.get("lm_head.weight", tw["model.embed_tokens.weight"]).double()
        self.p = "midlayer." if any(k.startswith("midlayer.") for k in self.w) else "layers.0."
        lc = self.lc
        theta = lc.get("rope_theta") or (lc.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        self.theta = 10000.0 if writer == "eagle-llm-1.2" else theta
        types = lc.get("layer_types") or []
        self.window = lc.get("sliding_window") if types and types[0] == "sliding_attention" else None
        self.nbr = cfg.get("norm_before_residual", writer == "speculators")
        self.eps = lc["rms_norm_eps"]

    def attention(self, x, pos, mask):
        c, w, p = self.lc, self.w, self.p
        nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // nh
        T = x.shape[0]
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd), pos, self.theta)
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd), pos, self.theta)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("thd,shd->hts", q, k) / hd**0.5
        seen = mask.clone()
        if self.window:
            seen &= (pos[:, None] - pos[None, :]) < self.window
        s = s.masked_fill(~seen, float("-inf"))
        a = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, nh * hd)
        return a @ w[p + "self_attn.o_proj.weight"].T

    def mlp_block(self, a):
        w, p = self.w, self.p
        m = rms(a, w[p + "post_attention_layernorm.weight"], self.eps)
        up = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
        return a + up @ w[p + "mlp.down_proj.weight"].T

    @torch.no_grad()
    def __call__(self, features, fed, embeds, positions, mask):
        w, p, eps = self.w, self.p, self.eps
        e = embeds.double()
        if self.writer == "eagle-llm-1.2":  # EAGLE-1/2: fc over [embedding; feature or fed-back state]
            z = torch.cat([e, torch.cat((features.double(), fed.double()))], -1) @ w["fc.weight"].T
            z = z + w["fc.bias"] if "fc.bias" in w else z
            g = self.mlp_block(z + self.attention(z, positions, mask))  # layer 0: no input norm
            return g, torch.log_softmax(g @ self.target_lm_head.T, -1)
        f = features.double()
        if "input_norm.weight" in w:
            f = rms(f, w["input_norm.weight"], eps)
        h = torch.cat((f @ w["fc.weight"].T, fed.double()))
        hn = rms(h, w[p + "hidden_norm.weight"], eps)
        u = torch.cat([rms(e, w[p + "input_layernorm.weight"], eps), hn], -1)
        g = self.mlp_block((hn if self.nbr else h) + self.attention(u, positions, mask))
        normed = rms(g, w["norm.weight"], eps)
        out = self.cfg.get("norm_output", False)
        if self.writer == "specforge-0.2":
            logits = (normed if out else g) @ w["lm_head.weight"].T
            return g, torch.log_softmax(logits, -1)
        return (normed if out else g), torch.log_softmax(normed @ w["lm_head.weight"].T, -1)
