"""Train the fixture's small Llama target on a token stream (next-token loss), deterministically on CPU.

Deep and narrow on purpose: on ONNX Runtime CPU a small model's forward costs roughly per layer, so a
16-layer target costs many times a one-layer draft step, as a 7B target does on a GPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from .fixture_data import windows


@dataclass(frozen=True)
class TargetRecipe:
    hidden_size: int = 192
    num_hidden_layers: int = 16
    num_attention_heads: int = 3
    num_key_value_heads: int = 1
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    seq_len: int = 256
    batch: int = 16
    steps: int = 450
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    seed: int = 0

    def config(self, vocab_size: int, bos: int, eos: int):
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads, intermediate_size=self.intermediate_size,
            vocab_size=vocab_size, max_position_embeddings=self.max_position_embeddings, rms_norm_eps=1e-6,
            tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.02)
        cfg.architectures = ["LlamaForCausalLM"]
        return cfg


def lr_at(step: int, r: TargetRecipe) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    frac = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, batch: int = 16) -> float:
    losses = [float(model(input_ids=data[i:i + batch], labels=data[i:i + batch]).loss)
              for i in range(0, len(data), batch)]
    return float(np.mean(losses))


def train_target(stream_train: np.ndarray, stream_val: np.ndarray, vocab_size: int, bos: int, eos: int,
                 r: TargetRecipe, log=print):
    """Returns (model in eval mode, {"train_loss": ..., "val_loss": ..., "seconds": ...})."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(r.seed)
    model = LlamaForCausalLM(r.config(vocab_size, bos, eos)).float()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f} M parameters, {r.steps} steps of {r.batch} x {r.seq_len} tokens")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=r.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(r.seed)
    val = windows(stream_val, 64, r.seq_len, np.random.default_rng(r.seed + 1))
    t0 = time.perf_counter()
    model.train()
    recent: list[float] = []
    for step in range(r.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        x = windows(stream_train, r.batch, r.seq_len, rng)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if (step + 1) % 50 == 0 or step == r.steps - 1:
            el = time.perf_counter() - t0
            log(f"  target step {step + 1}/{r.steps}  loss {np.mean(recent[-50:]):.3f}  lr {lr_at(step, r):.2e}  "
                f"{(step + 1) * r.batch * r.seq_len / el:.0f} tok/s  {el / 60:.1f} min")
    model.eval()
    stats = {"train_loss": float(np.mean(recent[-50:])), "val_loss": eval_loss(model, val),
             "seconds": time.perf_counter() - t0, "params": n_params,
             "tokens_seen": r.steps * r.batch * r.seq_len}
    log(f"target: val loss {stats['val_loss']:.3f} (train {stats['train_loss']:.3f}) in "
        f"{stats['seconds'] / 60:.1f} min")
    return model, stats
