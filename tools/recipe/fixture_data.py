"""Data for the trained fixture: an offline code corpus, its BPE tokenizer, token windows, and the
target's own greedy continuations with the features EAGLE heads learn from.

The corpus is the Python standard library of the running interpreter (``.py`` files under
``sysconfig.get_paths()["stdlib"]``, sorted by path, tests and site-packages excluded): present on every
machine that runs this project, no network needed. Its SHA-256 is recorded in the fixture card, so a
rebuild on another Python version says that its corpus differs.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (Llama order)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


@dataclass
class Corpus:
    files: list[str]  # paths relative to the stdlib root, in corpus order
    texts: list[str]
    sha256: str
    root: str

    @property
    def chars(self) -> int:
        return sum(len(t) for t in self.texts)


def stdlib_corpus(max_chars: int = 12_000_000, max_file_chars: int = 200_000) -> Corpus:
    """The interpreter's standard-library Python sources, sorted by relative path, up to ``max_chars``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1])))
    files, texts, total = [], [], 0
    digest = hashlib.sha256()
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or len(text) > max_file_chars:
            continue
        if total + len(text) > max_chars:
            break
        rel = str(p.relative_to(root))
        files.append(rel)
        texts.append(text)
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
        total += len(text)
    if not texts:
        raise RuntimeError(f"no Python sources found under {root}: cannot build the corpus")
    return Corpus(files, texts, digest.hexdigest(), str(root))


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (all 256 bytes in the base vocabulary, so any text encodes), <s> prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return tok


def save_tokenizer(tok, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(out_dir)


def token_stream(tok, texts: list[str]) -> np.ndarray:
    """All documents as one int32 stream: <s> doc </s> <s> doc </s> ..."""
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], dtype=np.int32))
    return np.concatenate(parts)


def windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    """n random windows of ``length`` tokens from the stream, as int64 [n, length]."""
    starts = rng.integers(0, len(stream) - length, size=n)
    return torch.from_numpy(np.stack([stream[s:s + length] for s in starts]).astype(np.int64))


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, new_tokens: int, batch: int = 64) -> torch.Tensor:
    """The target's own greedy continuations (KV cache), returned with their prompts: [n, P + new_tokens]."""
    out = []
    for i in range(0, len(prompts), batch):
        ids = prompts[i:i + batch]
        res = model(input_ids=ids, use_cache=True)
        cache = res.past_key_values
        nxt = res.logits[:, -1].argmax(-1, keepdim=True)
        seq = [ids, nxt]
        for _ in range(new_tokens - 1):
            res = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
            seq.append(nxt)
        out.append(torch.cat(seq, 1))
    return torch.cat(out)


@torch.no_grad()
def target_features(model, seqs: torch.Tensor, tap_layers: list[int], batch: int = 32
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the exported verify graph gives the draft, for every position of every sequence.

    Returns (last [n, S, H]: the final-norm output, EAGLE-1/2's features and the input of lm_head;
    taps [n, S, len(tap_layers) * H]: the *inputs* of the given decoder layers, concatenated, EAGLE-3's).
    """
    taps: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: taps.__setitem__(i, (args[0] if args else kwargs["hidden_states"])),
        with_kwargs=True) for i in tap_layers]
    last, tapped = [], []
    try:
        for i in range(0, len(seqs), batch):
            res = model.model(input_ids=seqs[i:i + batch])
            last.append(res.last_hidden_state.float())
            tapped.append(torch.cat([taps[j].float() for j in tap_layers], -1))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(last), torch.cat(tapped)
