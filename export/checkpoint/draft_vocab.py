"""`export --draft-vocab N`: which N target tokens the draft keeps, ranked by a text corpus or by token id.

The draft's last step is an lm_head over its whole vocabulary (the target's 128k rows for an EAGLE-1/2 head on a
Llama 3 target), computed at every tree level although the tree only keeps a few ids. Keeping the N most frequent
tokens cuts that matrix (and the top-k over it) to N rows; the target verifies every token, so output does not
change, only acceptance can drop when the target's next token is not among them.

Ranking (``rank``): EOS ids first (a draft that cannot propose EOS spends a round on every end of text), then by
count in the corpus (``--draft-vocab-corpus``, tokenized with the target's tokenizer), ties and tokens the corpus
never shows by ascending id. Without a corpus, a proxy from the tokenizer itself:

- **merge rank** (a BPE ``tokenizer.json``: Llama 3, Qwen, GPT-2 style): BPE training merges the most frequent pair
  first, so a token made by an early merge is a frequent one. A merged token ranks at the merge that makes it, a
  base token (a byte or character of the alphabet) at the first merge that uses it; tokens no merge makes or uses
  (added special tokens, bytes that never occur) come last. Not plain id order: byte-level BPE numbers its 256 bytes
  first, most of which are rare (on the fixture, keeping the 256 lowest ids halved tau).
- **token id** otherwise (SentencePiece numbers pieces by score; no tokenizer file): ascending id.

Both are proxies for the tokenizer's training text; a corpus like the deployment's own traffic ranks better.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_export.errors import CheckpointError, EagleExportError
from eagle_export.manifest import DraftVocabInfo
from eagle_export.progress import progress_bar

log = logging.getLogger(__name__)

# The corpus is tokenized in pieces of about this many characters, cut at line ends: a progress step each, and a
# batch the fast tokenizer spreads over its threads. A token spanning a cut is split in two there (one in ~10^5).
PIECE_CHARS = 1 << 20
BATCH_CHARS = 1 << 14


@dataclass(frozen=True)
class CorpusCounts:
    """Per target id, how often it occurs in the corpus, and what was counted."""

    counts: torch.Tensor  # int64 [target vocab]
    path: Path
    sha256: str
    tokens: int


def check_size(n: int, head_vocab: int, max_top_k: int, variant: str) -> None:
    """N must prune (below the head's vocabulary) and leave the draft graph's top-k its ``max_top_k`` ids."""
    whose = "the target's vocabulary" if variant == "eagle1" else "the EAGLE-3 head's draft vocabulary"
    if n >= head_vocab:
        raise EagleExportError(f"--draft-vocab {n} must be below {whose} ({head_vocab} tokens): nothing to prune")
    if n < max_top_k:
        raise EagleExportError(f"--draft-vocab {n} is below --max-top-k {max_top_k}: the draft graph's top-k takes "
                               f"{max_top_k} ids per row; keep at least that many tokens or lower --max-top-k")


def check_options(n: int | None, corpus: str | Path | None) -> None:
    """What can be checked before loading anything: N positive, a corpus only with N, and a corpus that reads as
    text."""
    if n is None:
        if corpus is not None:
            raise EagleExportError("--draft-vocab-corpus needs --draft-vocab N (how many tokens to keep)")
        return
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise EagleExportError(f"--draft-vocab must be a positive number of tokens, got {n!r}")
    if corpus is not None:
        _check_text(Path(corpus), _read(Path(corpus), 1 << 20), final=False)  # its first MiB, before the slow part


def _read(path: Path, size: int = -1) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as e:
        raise EagleExportError(f"--draft-vocab-corpus {path}: cannot read it ({e.strerror or e})") from None


def _check_text(path: Path, raw: bytes, final: bool) -> str:
    """``raw`` decoded; NUL bytes (a binary file), invalid UTF-8 and an empty file are one-line errors. ``final``
    False: ``raw`` is the file's beginning, which may end inside a character."""
    if b"\0" in raw:
        raise EagleExportError(f"--draft-vocab-corpus {path}: not a text file (it holds NUL bytes)")
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=final)
    except UnicodeDecodeError as e:
        raise EagleExportError(f"--draft-vocab-corpus {path}: not UTF-8 text (byte {e.start})") from None
    if not raw.strip():
        raise EagleExportError(f"--draft-vocab-corpus {path}: the file is empty")
    return text


def read_corpus(path: str | Path) -> str:
    """The corpus as text; unreadable, binary, non-UTF-8 or empty files are one-line errors."""
    return _check_text(Path(path), _read(Path(path)), final=True)


def _pieces(text: str, size: int) -> list[str]:
    """``text`` in consecutive pieces of about ``size`` characters, each cut after a line end where there is one."""
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        out.append(text[start:end])
        start = end
    return out


def count_corpus(path: str | Path, tokenizer_dir: Path, vocab: int, progress: bool = True) -> CorpusCounts:
    """Tokenize the corpus with the target's tokenizer (no special tokens added) and count each id."""
    text = read_corpus(path)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as e:  # transformers raises many types; name the directory and its message
        raise CheckpointError(f"--draft-vocab-corpus: cannot load the target's tokenizer from {tokenizer_dir} "
                              f"({type(e).__name__}: {e})") from None
    counts = torch.zeros(vocab, dtype=torch.long)
    pieces = _pieces(text, PIECE_CHARS)
    bar = progress_bar(len(pieces), "draft vocab: tokenizing the corpus", "piece", progress and len(pieces) > 1)
    total = 0
    try:
        for piece in pieces:
            batch = _pieces(piece, BATCH_CHARS)
            for ids in tok(batch, add_special_tokens=False)["input_ids"]:
                t = torch.tensor(ids, dtype=torch.long)
                if len(t) and int(t.max()) >= vocab:
                    raise CheckpointError(f"--draft-vocab-corpus: the tokenizer in {tokenizer_dir} gives id "
                                          f"{int(t.max())}, outside the target's vocabulary of {vocab}")
                counts += torch.bincount(t, minlength=vocab)
                total += len(t)
            bar.update()
    finally:
        bar.close()
    return CorpusCounts(counts, Path(path).resolve(), hashlib.sha256(text.encode("utf-8")).hexdigest(), total)


def merge_ranks(tokenizer_dir: Path | None, vocab: int) -> torch.Tensor | None:
    """Per target id, the index of the first BPE merge that makes or uses the token (``vocab``-wide; never: the merge
    count); None when there is no BPE ``tokenizer.json`` with merges (see the module docstring)."""
    path = None if tokenizer_dir is None else Path(tokenizer_dir) / "tokenizer.json"
    if path is None or not path.is_file():
        return None
    try:
        model = json.loads(path.read_text()).get("model") or {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--draft-vocab: cannot read {path} ({type(e).__name__}: {e})") from None
    merges, ids = model.get("merges"), model.get("vocab")
    if model.get("type") != "BPE" or not merges or not isinstance(ids, dict):
        return None
    never = len(merges)
    ranks = [never] * vocab
    for i, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        for tok in (a, b, a + b):
            j = ids.get(tok)
            if j is not None and 0 <= j < vocab and ranks[j] == never:
                ranks[j] = i
    return torch.tensor(ranks, dtype=torch.long)


def rank(candidates: torch.Tensor, n: int, eos: list[int], counts: torch.Tensor | None,
         order: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` best of ``candidates`` (target ids: the head's vocabulary), ascending: EOS ids first, then by
    ``counts`` (descending; None: not used), then by ``order`` (ascending, e.g. ``merge_ranks``; None: not used),
    then by ascending id (see the module docstring)."""
    cand = candidates.to(torch.long)
    ids = cand.tolist()
    eos_set = set(eos)
    c = [0] * len(ids) if counts is None else counts[cand].tolist()
    o = [0] * len(ids) if order is None else order[cand].tolist()
    best = sorted(range(len(ids)), key=lambda j: (ids[j] not in eos_set, -c[j], o[j], ids[j]))
    return torch.tensor(sorted(ids[j] for j in best[:n]), dtype=torch.long)


def choose(n: int, candidates: torch.Tensor, eos: list[int], corpus: str | Path | None, tokenizer_dir: Path | None,
           vocab: int, progress: bool = True) -> tuple[torch.Tensor, DraftVocabInfo]:
    """The kept target ids (ascending) and the manifest's record of how they were chosen."""
    if corpus is None:
        merges = merge_ranks(tokenizer_dir, vocab)
        kept = rank(candidates, n, eos, None, merges)
        return kept, DraftVocabInfo(size=n, pruned_from=len(candidates),
                                    ranking="token-id" if merges is None else "merge-rank")
    if tokenizer_dir is None:
        raise CheckpointError("--draft-vocab-corpus: the target has no tokenizer files to tokenize the corpus with")
    cc = count_corpus(corpus, tokenizer_dir, vocab, progress)
    kept = rank(candidates, n, eos, cc.counts)
    seen = int((cc.counts[candidates.to(torch.long)] > 0).sum())
    if seen < n:
        log.warning("--draft-vocab %d: the corpus (%d tokens) shows only %d distinct tokens of the head's vocabulary; "
                    "the other %d kept are the lowest ids", n, cc.tokens, seen, n - seen)
    return kept, DraftVocabInfo(size=n, pruned_from=len(candidates), ranking="corpus", corpus=str(cc.path),
                                corpus_sha256=cc.sha256, corpus_tokens=cc.tokens)
