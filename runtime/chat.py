"""Chat prompts: check a list of messages and turn it into prompt ids with the tokenizer's chat template.

One place for what `generate --chat`, ``EagleRuntime.generate(messages=...)`` and the ``{"messages": [...]}``
lines of prompt files mean: the tokenizer's own template, rendered with ``add_generation_prompt=True`` (the
prompt ends where the assistant's answer starts), tokenized as transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

from typing import Any

from eagle_export.errors import GenerationError

MESSAGE_SHAPE = '{"role": "user", "content": "text"}'


def user_message(text: str) -> list[dict[str, str]]:
    """A one-turn conversation: ``text`` as the user's message (what `generate --chat --prompt TEXT` sends)."""
    return [{"role": "user", "content": text}]


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """``messages`` if it is a non-empty list of objects with a non-empty string ``role`` and a string
    ``content``; else a GenerationError naming ``where`` and the first bad message. Other keys are kept
    (a template may read them)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise GenerationError(f"{where} must be a non-empty list of messages, each {MESSAGE_SHAPE}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GenerationError(f"{where}[{i}] is a {type(m).__name__}, not an object {MESSAGE_SHAPE}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise GenerationError(f"{where}[{i}] needs a non-empty string \"role\", as in {MESSAGE_SHAPE}")
        if not isinstance(content, str):
            raise GenerationError(f"{where}[{i}] needs a string \"content\", as in {MESSAGE_SHAPE}")
    return list(messages)


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer, messages: Any, owner: str) -> list[int]:
    """Prompt ids of ``messages`` under the tokenizer's chat template, ending with the generation prompt.

    owner: what holds the tokenizer (the artifact directory), named in the errors: no tokenizer, a tokenizer
    without a chat template, or a template that rejects these messages (e.g. roles that do not alternate).
    """
    messages = check_messages(messages)
    if tokenizer is None:
        raise GenerationError(f"{owner} has no tokenizer (the target had none at export), so chat messages cannot "
                              "be turned into ids: pass token ids instead")
    if not has_chat_template(tokenizer):
        raise GenerationError(f"{owner}: the tokenizer has no chat template (no chat_template.jinja, no "
                              "chat_template in tokenizer_config.json), so --chat / messages cannot be used: give "
                              "the prompt as plain text or ids, or export a target whose tokenizer has a template")
    try:
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except Exception as e:  # jinja2 errors, or the template's own raise_exception(...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise GenerationError(f"{owner}: the chat template failed on these messages ({type(e).__name__}: "
                              f"{first})") from None
    ids = [int(i) for i in enc["input_ids"]]
    if not ids:
        raise GenerationError(f"{owner}: the chat template rendered these messages as an empty prompt")
    return ids
