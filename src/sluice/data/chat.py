"""Render a row's prompt into the text the model sees, and tokenise it.

A prompt is a string or a list of chat messages (``{"role", "content"}``). With the chat template
on (``data.chat_template``: ``auto`` when the tokenizer has one, ``on``), the messages (a string
prompt becomes one user message, ``data.system_prompt`` a system message before them) go through
``tokenizer.apply_chat_template(..., add_generation_prompt=True)``, whose text already holds the
special tokens. With it off, a string prompt is tokenised as it is (with the tokenizer's own
special tokens, e.g. BOS) and a message list is an error naming the row: joining turns without the
model's template would train on a format the model never saw. Length limits are ``data/prompts.py``'s.
"""

from __future__ import annotations

from typing import Any

from sluice.config import ConfigError
from sluice.data.readers import DatasetError


class ChatRenderer:
    """One run's prompt rendering: ``render(prompt, where)`` → text, ``encode(text)`` → ids."""

    def __init__(self, tokenizer: Any, mode: str = "auto", system_prompt: str | None = None) -> None:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if mode == "on" and not has_template:
            raise ConfigError("data.chat_template: 'on', but the model's tokenizer has no chat template")
        self.templated = mode == "on" or (mode == "auto" and has_template)
        if system_prompt is not None and not self.templated:
            raise ConfigError(
                "data.system_prompt: needs a chat template, and this run renders none "
                f"(data.chat_template: {mode!r}{'' if has_template else ', the tokenizer has no template'})"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt

    def render(self, prompt: Any, where: str, key: str = "prompt") -> str:
        """The prompt as the model's input text."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DatasetError(f"{where}: the prompt at {key!r} is empty")
            if not self.templated:
                return prompt
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = chat_messages(prompt, where, key)
            if not self.templated:
                raise DatasetError(
                    f"{where}: the prompt at {key!r} is a list of chat messages, but the chat template is off "
                    "(data.chat_template: 'off', or the tokenizer has none); give a string prompt or a tokenizer "
                    "with a chat template"
                )
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return str(text)

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of a rendered prompt: a templated text already carries its special tokens."""
        return tuple(self.tokenizer(text, add_special_tokens=not self.templated)["input_ids"])


def chat_messages(prompt: Any, where: str, key: str) -> list[dict[str, str]]:
    """``prompt`` as a non-empty list of ``{role, content}`` string pairs, or one ``DatasetError``
    naming ``where`` and ``key``."""
    if not isinstance(prompt, list) or not prompt:
        raise DatasetError(
            f"{where}: the prompt at {key!r} must be a non-empty string or a non-empty list of "
            f"{{role, content}} messages, got {type(prompt).__name__} {prompt!r:.80}"
        )
    for k, message in enumerate(prompt):
        ok = (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        )
        if not ok:
            raise DatasetError(
                f"{where}: message {k + 1} of the prompt at {key!r} is not a {{role, content}} pair of "
                f"strings: {message!r:.80}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in prompt]
