"""Train the fixture's EAGLE heads on the target's own greedy text, with a training-time test.

Data: corpus prompts continued greedily by the trained target (the text a greedy EAGLE run drafts on), with
the target's features at every position (its final-norm output for EAGLE-1/2, the inputs of three decoder
layers for EAGLE-3).

Training-time test (EAGLE-3's recipe, used for both heads here): the head is unrolled ``unroll`` steps. Step 0
reads the target's feature at each position p (the draft's context rows); step s > 0 reads the head's own
step s-1 output, as a depth-s tree node does at inference, and attends to the step-0 keys up to p plus its own
chain of steps 1..s at p (exactly the draft cache a tree path sees). The input token at step s is the true
token p+1+s, which for the target's greedy text is what the tree holds when the steps before were accepted; so
the leading run of correct steps is the accept length a top-1 chain would get.

Losses: EAGLE-1/2 = smooth-L1 regression to the target's next feature + soft cross-entropy to the target's
next-token distribution (the target's lm_head on both); EAGLE-3 = soft cross-entropy over its own draft
vocabulary (the most frequent target tokens, written as ``d2t``/``t2d``). Both add a cross-entropy to the target's
greedy token (held-out top-1 agreement 0.85 -> 0.87 for EAGLE-1/2, 0.80 -> 0.85 for EAGLE-3 in the fixture's
run). Later steps weigh 0.8^s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from eagle_export.export.graphs.attention import apply_rope, rope_tables

from .fixture_data import greedy_continue, target_features


@dataclass(frozen=True)
class HeadRecipe:
    prompts: int = 896
    # Generation batches cycle through these prompt lengths; each sequence is seq_len tokens in all, the rest the
    # target's greedy continuation. Short prompts matter: a chat or completion request starts with a few tokens.
    prompt_lens: tuple[int, ...] = (8, 16, 32, 64, 96)
    seq_len: int = 224
    doc_start_share: float = 0.5  # share of prompts that start at a document start (<s>), as a request does
    gen_batch: int = 64
    heldout: int = 64
    unroll: int = 5
    batch: int = 8
    steps: int = 500
    lr: float = 2e-3
    warmup: int = 30
    ce_weight_eagle1: float = 1.0
    # Cross-entropy to the target's greedy token on top of the soft one: a weak target's next-token distribution is
    # broad, and the soft loss alone spends the head's capacity on its tail; greedy acceptance needs the argmax.
    hard_ce_weight: float = 1.0
    draft_vocab: int = 1024
    seed: int = 0


@dataclass
class HeadData:
    seqs: torch.Tensor  # [n, N] int64: prompt + the target's greedy continuation
    last: torch.Tensor  # [n, N, H]: final-norm features (EAGLE-1/2 features, lm_head input)
    taps: torch.Tensor  # [n, N, 3H]: inputs of the EAGLE-3 feature layers
    tap_layers: list[int]
    prompt_lens: torch.Tensor  # [n]: where each sequence's generated part starts
    seconds: float

    def summary(self) -> dict:
        return {"sequences": int(self.seqs.shape[0]), "seq_len": int(self.seqs.shape[1]),
                "prompt_lens": sorted({int(x) for x in self.prompt_lens}), "tap_layers": self.tap_layers,
                "seconds": self.seconds}


def _load_target(work: Path):
    from eagle_export.export.checkpoint.loaders import load_target

    t = load_target(work / "target", progress=False)
    for p in t.model.parameters():
        p.requires_grad_(False)
    return t


def make_head_data(work: Path, r: HeadRecipe, log=print) -> HeadData:
    from eagle_export.export.checkpoint.loaders import default_feature_layers

    t0 = time.perf_counter()
    target = _load_target(work)
    stream = np.load(work / "stream.npy")
    rng = np.random.default_rng(r.seed + 7)
    doc_starts = np.flatnonzero(stream == 1)  # <s>
    log(f"heads: {r.prompts} corpus prompts of {', '.join(map(str, r.prompt_lens))} tokens "
        f"({r.doc_start_share:.0%} at document starts), continued greedily by the target to {r.seq_len} tokens")
    seqs, lens = [], []
    for b, i in enumerate(range(0, r.prompts, r.gen_batch)):
        n = min(r.gen_batch, r.prompts - i)
        plen = r.prompt_lens[b % len(r.prompt_lens)]
        n_doc = int(round(n * r.doc_start_share))
        starts = np.concatenate([rng.choice(doc_starts[doc_starts < len(stream) - plen], n_doc),
                                 rng.integers(0, len(stream) - plen, n - n_doc)])
        prompts = torch.from_numpy(np.stack([stream[s:s + plen] for s in starts]).astype(np.int64))
        seqs.append(greedy_continue(target.model, prompts, r.seq_len - plen))
        lens += [plen] * n
        log(f"  generated {i + n}/{r.prompts}  {(time.perf_counter() - t0) / 60:.1f} min")
    seqs = torch.cat(seqs)
    order = torch.from_numpy(rng.permutation(len(seqs)))  # held-out rows: a mix of prompt lengths
    seqs, lens = seqs[order], torch.tensor(lens)[order]
    layers = default_feature_layers(target.config.num_hidden_layers)
    last, taps = target_features(target.model, seqs, layers)
    data = HeadData(seqs, last, taps, layers, lens, time.perf_counter() - t0)
    log(f"heads: data {tuple(seqs.shape)} + features in {data.seconds / 60:.1f} min (EAGLE-3 taps: layers {layers})")
    return data


def ttt_forward(head, variant: str, ids: torch.Tensor, feats: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """The head unrolled ``unroll`` steps over all positions at once; returns each step's hidden [B, N-unroll, H]."""
    B, N = ids.shape
    n = N - unroll
    e3 = variant == "eagle3"
    layer = head.midlayer if e3 else head.layers[0]
    attn = layer.self_attn
    hd = attn.head_dim
    pos = torch.arange(n).expand(B, n)
    future = ~torch.ones(n, n, dtype=torch.bool).tril()
    keys, vals, outs = [], [], []
    prev = None
    for s in range(unroll):
        emb = head.embed_tokens(ids[:, 1 + s:1 + s + n])
        if e3:
            h = head.fc(feats[:, :n]) if s == 0 else prev
            x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(h)), -1)
            resid = h
        else:
            x = head.fc(torch.cat((emb, feats[:, :n] if s == 0 else prev), -1))
            resid = x
        cos, sin = rope_tables(head.rotary_emb, x, pos + s, hd)
        q = apply_rope(attn.q_proj(x).view(B, n, -1, hd), cos, sin, hd)
        k = apply_rope(attn.k_proj(x).view(B, n, -1, hd), cos, sin, hd)
        v = attn.v_proj(x).view(B, n, -1, hd)
        rep = q.shape[2] // k.shape[2]
        keys.append(k.repeat_interleave(rep, 2))
        vals.append(v.repeat_interleave(rep, 2))
        # Step-0 keys up to the anchor (the draft's context cache), then the anchor's own chain (tree path + self).
        s0 = torch.einsum("bqhd,bkhd->bhqk", q, keys[0]).masked_fill(future, float("-inf"))
        chain = [(q * keys[t]).sum(-1).transpose(1, 2).unsqueeze(-1) for t in range(1, s + 1)]
        probs = torch.softmax(torch.cat([s0, *chain], -1) * attn.scaling, -1)
        o = torch.einsum("bhqk,bkhd->bqhd", probs[..., :n], vals[0])
        for j, t in enumerate(range(1, s + 1)):
            o = o + probs[..., n + j].transpose(1, 2).unsqueeze(-1) * vals[t]
        g = resid + attn.o_proj(o.reshape(B, n, -1))
        g = g + layer.mlp(layer.post_attention_layernorm(g))
        outs.append(g)
        prev = g
    return outs


def _draft_vocab(seqs: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids in the head data (ties by id), ascending: EAGLE-3's draft vocabulary."""
    counts = np.bincount(seqs.reshape(-1).numpy(), minlength=vocab)
    order = np.lexsort((np.arange(vocab), -counts))[:size]
    return torch.from_numpy(np.sort(order)).to(torch.int64)


def _init_head(work: Path, variant: str, target, draft_ids: torch.Tensor | None, seed: int):
    """A fresh head written in the published layout by tiny_models, then loaded through the real loader."""
    from safetensors.torch import load_file

    from eagle_export.export.checkpoint.loaders import load_draft_head
    from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_eagle3_draft, write_head

    out = work / variant
    tdir = work / "target"
    if variant == "eagle1":
        make_tiny_draft(out, tdir, seed=seed, fc_bias=True, init_scale=0.02, norm_noise=0.0)
    else:
        V = target.config.vocab_size
        make_tiny_eagle3_draft(out, tdir, seed=seed, draft_vocab_size=len(draft_ids), init_scale=0.02, norm_noise=0.0)
        tensors = load_file(str(out / "model.safetensors"))
        tensors["d2t"] = (draft_ids - torch.arange(len(draft_ids))).to(torch.int64)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[draft_ids] = True
        tensors["t2d"] = t2d
        import json

        write_head(out, json.loads((out / "config.json").read_text()), tensors, "safetensors")
    loaded = load_draft_head(out, target)
    return loaded.head.float().train(), out


def _save_head(head, out: Path) -> None:
    """Write the trained weights over the head's file, same keys (the published layout), d2t/t2d kept."""
    import json

    from safetensors.torch import load_file

    from eagle_export.tools.testing.tiny_models import write_head

    tensors = load_file(str(out / "model.safetensors"))
    state = head.state_dict()
    for k in tensors:
        if k not in ("d2t", "t2d"):
            tensors[k] = state[k].detach().float().contiguous()
    write_head(out, json.loads((out / "config.json").read_text()), tensors, "safetensors")


def _losses(head, variant, target, ids, last, feats, r: HeadRecipe, draft_ids):
    """Weighted loss over the unrolled steps, and per-step (agree [B, n] bool) for accuracy."""
    outs = ttt_forward(head, variant, ids, feats, r.unroll)
    n = ids.shape[1] - r.unroll
    with torch.no_grad():
        t_logits = target.model.lm_head(last)  # [B, N, V]
    if draft_ids is not None:  # target id -> draft id, -100 (ignored) outside the draft vocabulary
        to_draft = torch.full((t_logits.shape[-1],), -100, dtype=torch.int64)
        to_draft[draft_ids] = torch.arange(len(draft_ids))
    total, agree = 0.0, []
    for s, g in enumerate(outs):
        tl = t_logits[:, 1 + s:1 + s + n]
        greedy = tl.argmax(-1)
        if variant == "eagle1":
            d_logits = head.lm_head(g)
            ce = -(torch.softmax(tl, -1) * torch.log_softmax(d_logits, -1)).sum(-1).mean()
            reg = F.smooth_l1_loss(g, last[:, 1 + s:1 + s + n])
            hard = F.cross_entropy(d_logits.flatten(0, 1), greedy.flatten())
            loss = reg + r.ce_weight_eagle1 * ce + r.hard_ce_weight * hard
            pred = d_logits.argmax(-1)
        else:
            d_logits = head.lm_head(head.norm(g))
            soft = -(torch.softmax(tl[..., draft_ids], -1) * torch.log_softmax(d_logits, -1)).sum(-1).mean()
            hard = F.cross_entropy(d_logits.flatten(0, 1), to_draft[greedy].flatten(), ignore_index=-100)
            loss = soft + r.hard_ce_weight * hard
            pred = draft_ids[d_logits.argmax(-1)]
        total = total + (0.8 ** s) * loss
        agree.append(pred == greedy)
    return total, agree


def chain_figures(agree: list[torch.Tensor], gen_from: torch.Tensor) -> dict:
    """Per-step top-1 agreement and the mean leading run of agreeing steps, over anchors whose first predicted
    token lies in the generated text (positions >= gen_from[b] of sequence b)."""
    a = torch.stack(agree, -1)  # [B, n, unroll]
    keep = torch.arange(a.shape[1])[None, :] >= (gen_from[:, None] - 1)
    a = a[keep]  # [anchors, unroll]
    per_step = a.float().mean(0).tolist()
    lead = torch.cumprod(a.int(), -1).sum(-1).float().mean().item()
    return {"top1_agreement_per_step": [round(x, 4) for x in per_step], "mean_accepted_chain": round(lead, 3),
            "chain_tau": round(1.0 + lead, 3)}


def train_head(work: Path, variant: str, data: HeadData, r: HeadRecipe, log=print) -> dict:
    """Train one head in place of its initial file in work/<variant>; returns its figures."""
    t0 = time.perf_counter()
    torch.manual_seed(r.seed)
    target = _load_target(work)
    draft_ids = None
    if variant == "eagle3":
        draft_ids = _draft_vocab(data.seqs, target.config.vocab_size, r.draft_vocab)
    head, out = _init_head(work, variant, target, draft_ids, r.seed + 1)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=r.lr, betas=(0.9, 0.95), weight_decay=0.0)
    feats_all = data.last if variant == "eagle1" else data.taps
    ntrain = len(data.seqs) - r.heldout
    rng = np.random.default_rng(r.seed + 3)
    log(f"{variant}: {sum(p.numel() for p in params) / 1e6:.2f} M trainable parameters, {r.steps} steps of "
        f"{r.batch} sequences, unroll {r.unroll}")
    recent = []
    for step in range(r.steps):
        lr = r.lr * min(1.0, (step + 1) / r.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / r.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.from_numpy(rng.integers(0, ntrain, r.batch))
        loss, _ = _losses(head, variant, target, data.seqs[idx], data.last[idx], feats_all[idx], r, draft_ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if (step + 1) % 50 == 0 or step == r.steps - 1:
            log(f"  {variant} step {step + 1}/{r.steps}  loss {np.mean(recent[-50:]):.4f}  "
                f"{(time.perf_counter() - t0) / 60:.1f} min")
    head.eval()
    with torch.no_grad():
        ho = slice(ntrain, len(data.seqs))
        _, agree = _losses(head, variant, target, data.seqs[ho], data.last[ho], feats_all[ho], r, draft_ids)
    figures = chain_figures(agree, data.prompt_lens[ho])
    figures.update({"train_loss": float(np.mean(recent[-50:])), "seconds": time.perf_counter() - t0,
                    "params": sum(p.numel() for p in params)})
    if draft_ids is not None:
        figures["draft_vocab"] = len(draft_ids)
    _save_head(head, out)
    log(f"{variant}: held-out top-1 agreement per step {figures['top1_agreement_per_step']}, "
        f"chain tau {figures['chain_tau']} ({figures['seconds'] / 60:.1f} min)")
    return figures
