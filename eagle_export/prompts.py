"""Prompt files: the one reader of the JSON-lines prompt sets that `bench`, `tune` and `validate` take.

Each non-blank line is one JSON object with exactly one of:

- ``{"prompt": "text"}``: encoded with the artifact's tokenizer (its special tokens added);
- ``{"prompt_ids": [1, 2, 3]}``: token ids as they are;
- ``{"messages": [{"role": "user", "content": "text"}, ...]}``: a conversation, through the tokenizer's chat
  template with the generation prompt appended (runtime/chat.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle_export.errors import EagleExportError, GenerationError

PROMPT_KEYS = ("prompt", "prompt_ids", "messages")
LINE_SHAPE = ('each line must be a JSON object {"prompt": "text"} or {"prompt_ids": [1, 2, 3]} or '
              '{"messages": [{"role": "user", "content": "text"}]}')


class PromptFileError(EagleExportError):
    """A prompts file that cannot be read, a malformed line, or a line the artifact cannot encode."""


@dataclass(frozen=True)
class PromptSpec:
    source: str  # "builtin 1" or "FILE:LINE", used in error messages
    text: str | None = None
    ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None


def read_prompts(path: str | Path) -> list[PromptSpec]:
    """The prompts of a JSON-lines file, in order; blank lines are skipped. A bad line is an error naming it."""
    from eagle_export.runtime.chat import check_messages

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"cannot read the prompts file {path}: {e}") from None
    specs = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: not valid JSON ({e.msg}): {LINE_SHAPE}") from None
        if not isinstance(obj, dict) or len(obj.keys() & set(PROMPT_KEYS)) != 1:
            raise PromptFileError(f"{where}: {LINE_SHAPE}")
        extra = sorted(set(obj) - set(PROMPT_KEYS))
        if extra:
            raise PromptFileError(f"{where}: unknown key(s) {', '.join(extra)}: {LINE_SHAPE}")
        if "prompt" in obj:
            text = obj["prompt"]
            if not isinstance(text, str) or not text:
                raise PromptFileError(f"{where}: \"prompt\" must be a non-empty string")
            specs.append(PromptSpec(where, text=text))
        elif "prompt_ids" in obj:
            ids = obj["prompt_ids"]
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids)):
                raise PromptFileError(f"{where}: \"prompt_ids\" must be a non-empty list of integers")
            specs.append(PromptSpec(where, ids=tuple(ids)))
        else:
            try:
                messages = check_messages(obj["messages"], f"{where}: \"messages\"")
            except GenerationError as e:
                raise PromptFileError(str(e)) from None
            specs.append(PromptSpec(where, messages=tuple(messages)))
    if not specs:
        raise PromptFileError(f"{path}: no prompts (the file has no non-blank lines)")
    return specs


def prompt_ids(rt, spec: PromptSpec) -> list[int]:
    """The token ids of one prompt on an opened ``EagleRuntime`` (its tokenizer, its chat template, its
    vocabulary); an error names the prompt's line."""
    if spec.ids is not None:
        vocab = rt.manifest.target.vocab_size
        bad = [x for x in spec.ids if not 0 <= x < vocab]
        if bad:
            raise PromptFileError(f"{spec.source}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return list(spec.ids)
    if rt.tokenizer is None:
        kind = "a text prompt" if spec.text is not None else "a messages prompt"
        raise PromptFileError(f"{spec.source}: {kind} needs the artifact's tokenizer, and {rt.directory} has "
                              'none: give token ids instead ({"prompt_ids": [1, 2, 3]})')
    try:
        return rt.encode(spec.text) if spec.text is not None else rt.encode_chat(list(spec.messages))
    except GenerationError as e:
        raise PromptFileError(f"{spec.source}: {e}") from None
