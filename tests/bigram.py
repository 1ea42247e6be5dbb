"""A tiny target that is a bigram table, with an EAGLE-1/2 head that predicts it exactly.

The target's attention and MLP outputs are zeroed (o_proj, down_proj), so its last hidden state is the current
token's embedding, normalised; ``lm_head`` row ``next[x]`` is token x's embedding, so the argmax after x is
``next[x]`` by a margin of many nats (random 64-dimensional embeddings are nearly orthogonal). The head's ``fc``
passes the token embedding through and its layer adds nothing, so its top-1 is the same table: every draft is
accepted and a round commits ``depth + 2`` tokens. Output is then a fixed cycle of tokens, which makes EOS
inside a deep round, non-ASCII streaming and long runs exactly predictable on a real exported model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle_export.tools.tiny_models import make_tiny_draft, make_tiny_target

MARGIN = 24.0  # logit of the table's next token; every other token's is below about 0.5 * MARGIN


def _zero_outputs(tensors: dict[str, torch.Tensor]) -> None:
    for k, v in tensors.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[k] = torch.zeros_like(v)


def make_bigram_pair(root: Path, cycle: list[int], *, vocab: int = 384, seed: int = 0) -> tuple[Path, Path]:
    """(target, draft) directories whose greedy output after any token of ``cycle`` follows the cycle."""
    if len(set(cycle)) != len(cycle):
        raise ValueError("the cycle's tokens must be distinct (one successor each)")
    target = make_tiny_target(root / "target", "mha", seed=seed, with_tokenizer=True, vocab_size=vocab)
    path = target / "model.safetensors"
    t = load_file(str(path))
    _zero_outputs(t)
    emb = t["model.embed_tokens.weight"]
    h = emb.shape[1]
    head = torch.zeros_like(t["lm_head.weight"])
    for x, y in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        e = emb[x]
        head[y] = MARGIN * e / (e.norm() * e.norm() / h ** 0.5)  # dot with normalised e(x) is MARGIN
    t["lm_head.weight"] = head
    save_file(t, str(path))

    draft = make_tiny_draft(root / "draft", target, seed=seed + 1, fc_bias=False)
    dpath = draft / "model.safetensors"
    d = load_file(str(dpath))
    _zero_outputs(d)
    fc = torch.zeros_like(d["fc.weight"])
    fc[:, :h] = torch.eye(h)  # EAGLE-1/2 concatenates (token embedding, target feature): keep the embedding
    d["fc.weight"] = fc
    save_file(d, str(dpath))
    return target, draft
