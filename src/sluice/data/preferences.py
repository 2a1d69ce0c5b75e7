"""Rows → preference pairs: for each row, the (prompt text, response text) of its chosen and of
its rejected response, as a reward model reads them.

A row follows TRL's preference schema: ``rm.chosen_key`` / ``rm.rejected_key`` (``chosen`` /
``rejected``), each a string or chat messages, with an optional prompt at ``data.prompt_key``
(TRL's explicit prompt; without one, a conversation's last message is its response and the
messages before it its prompt, and a plain string is the whole text). The prompt is rendered by
the run's ``ChatRenderer`` (``data/chat.py``: the chat template with its generation prompt, or the
plain string), exactly as ``sluice train`` renders the prompts a policy answers, so a reward model
trained on these texts scores a policy's responses in the form it was trained on
(``rewards/reward_model.py`` tokenises both the same way). Every row a user can get wrong is one
``DatasetError`` naming the file, row and key. It does not tokenise, read files or train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.config.data import DataConfig
from sluice.config.rm import RmConfig
from sluice.data.chat import ChatRenderer, chat_messages
from sluice.data.mapping import has, lookup, require
from sluice.data.readers import DatasetError, RowSet


@dataclass(frozen=True)
class PreferenceTexts:
    """One row's pair: ``(prompt, response)`` texts of the chosen and of the rejected response."""

    chosen: tuple[str, str]
    rejected: tuple[str, str]
    where: str


@dataclass
class PreferenceRows:
    """The pairs of one split, and whether their prompts were rendered by a chat template."""

    pairs: list[PreferenceTexts] = field(default_factory=list)
    templated: bool = False


class PreferenceRenderer:
    """One run's pair rendering (``data`` and ``rm`` sections, the reward model's tokenizer)."""

    def __init__(self, tokenizer: Any, data: DataConfig, rm: RmConfig) -> None:
        self.chat = ChatRenderer(tokenizer, data.chat_template, data.system_prompt)
        self.data = data
        self.rm = rm

    def build(self, rows: RowSet) -> PreferenceRows:
        out = PreferenceRows(templated=self.chat.templated)
        for k, row in enumerate(rows.rows):
            out.pairs.append(self.pair(row, rows.where(k)))
        return out

    def pair(self, row: Any, where: str) -> PreferenceTexts:
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a mapping, got {type(row).__name__}")
        prompt = lookup(row, self.data.prompt_key) if has(row, self.data.prompt_key) else None
        chosen = require(row, self.rm.chosen_key, where, "chosen response", "rm.chosen_key")
        rejected = require(row, self.rm.rejected_key, where, "rejected response", "rm.rejected_key")
        pair = PreferenceTexts(
            self._texts(prompt, chosen, where, self.rm.chosen_key),
            self._texts(prompt, rejected, where, self.rm.rejected_key),
            where,
        )
        if pair.chosen == pair.rejected:
            raise DatasetError(f"{where}: the chosen and the rejected response are the same text")
        return pair

    def _texts(self, prompt: Any, response: Any, where: str, key: str) -> tuple[str, str]:
        """(rendered prompt, response) of one side of a pair."""
        if isinstance(response, str):
            if not response.strip():
                raise DatasetError(f"{where}: the response at {key!r} is empty")
            if prompt is None:  # TRL's implicit plain text: the whole string is scored
                return "", response
            return self.chat.render(prompt, where, self.data.prompt_key), response
        messages = chat_messages(response, where, key)
        if prompt is not None:
            head = (
                [{"role": "user", "content": prompt}]
                if isinstance(prompt, str)
                else chat_messages(prompt, where, self.data.prompt_key)
            )
            messages = [*head, *messages]
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            roles = ", ".join(m["role"] for m in messages)
            raise DatasetError(
                f"{where}: the conversation at {key!r} must end with an assistant message after a prompt "
                f"(roles: {roles})"
            )
        return self.chat.render(messages[:-1], where, key), messages[-1]["content"]
