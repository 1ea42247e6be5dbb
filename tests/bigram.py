"""A tiny target that is a bigram table, with an EAGLE-1/2 head that predicts it exactly.

The target's attention and MLP outputs are zeroed (o_proj, down_proj), so its last hidden state is the current
token's embedding, normalised; ``lm_head`` row ``next[x]`` is token x's embedding, so the argmax after x is
``next[x]`` by a margin of many nats (random 64-dimensional embeddings are nearly orthogonal). The head's ``fc``
passes the token embedding through and its layer adds nothing, so its top-1 is the same table: every draft is
accepted and a round commits ``depth + 2`` tokens. Output is then a fixed cycle of tokens, which makes EOS
inside a deep round, non-ASCII streaming and long runs exactly predictable on a real exported model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_target

MARGIN = 24.0  # logit of the table's next token; every other token's is below about 0.5 * MARGIN


def _zero_outputs(tensors: dict[str, torch.Tensor]) -> None:
    for k, v in tensors.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[k] = torch.zeros_like(v)


def make_bigram_pair(root: Path, cycle: list[int], *, vocab: int = 384, seed: int = 0,
                     wrong: Sequence[int] = (), feature_weight: float = 0.0, **target: object) -> tuple[Path, Path]:
    """(target, draft) directories whose greedy output after any token of ``cycle`` follows the cycle.

    wrong: tokens of the cycle after which the head drafts something else (its own embedding row of such a token is
    that of a token outside the cycle, whose successor is anybody's guess): a run through them is a stretch where no
    draft is accepted, with full acceptance before and after it (the speculation guard's test). feature_weight: the
    head's fc adds the target feature at this share of the token embedding's size, so its cache rows depend on the
    features it is fed (0: they do not) without changing what it drafts. target: config overrides of the target (its
    shape, e.g. the fixture's, so that a round costs what it costs there)."""
    if len(set(cycle)) != len(cycle):
        raise ValueError("the cycle's tokens must be distinct (one successor each)")
    spare = [t for t in range(3, vocab) if t not in set(cycle)]
    if not set(wrong) <= set(cycle) or len(wrong) > len(spare):
        raise ValueError("wrong must be tokens of the cycle, at most as many as the tokens outside it")
    target = make_tiny_target(root / "target", "mha", seed=seed, with_tokenizer=True, vocab_size=vocab, **target)
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

    draft = make_tiny_draft(root / "draft", target, seed=seed + 1, fc_bias=False,
                            own_embedding="copy" if wrong else False)
    dpath = draft / "model.safetensors"
    d = load_file(str(dpath))
    _zero_outputs(d)
    fc = torch.zeros_like(d["fc.weight"])
    fc[:, :h] = torch.eye(h)  # EAGLE-1/2 concatenates (token embedding, target feature): keep the embedding
    # The feature is the normalised embedding (norm sqrt(h)); scaled to feature_weight of an embedding row's norm.
    fc[:, h:] = feature_weight * float(emb[cycle].norm(dim=1).mean()) / h ** 0.5 * torch.eye(h)
    d["fc.weight"] = fc
    for x, z in zip(wrong, spare, strict=False):  # the head reads x as z: it drafts z's (garbage) successor
        d["embed_tokens.weight"][x] = emb[z]
    save_file(d, str(dpath))
    return target, draft
