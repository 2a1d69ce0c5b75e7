"""Rows → supervised examples: token ids and, per token, whether the loss is taken on it.

A row is a conversation (``sft.messages_key``: TRL's conversational ``messages``) or a prompt
and a response (``data.prompt_key`` / ``sft.response_key``, dotted paths: TRL's ``prompt`` /
``completion``, verl's SFT parquet), each a string or chat messages. With a chat template
(``data.chat_template``, as ``data/chat.py`` decides it) the conversation is rendered by
``tokenizer.apply_chat_template``; the assistant tokens come from the template's own
``{% generation %}`` marks (``return_assistant_tokens_mask``) where it has them, else by rendering
each assistant turn's prefix with the generation prompt and the prefix through the turn: the
characters in between (the turn's content and its end-of-turn tokens) are the turn's, mapped to
tokens by the tokenizer's offsets. Without a template a string prompt and response are tokenised
as they are (the prompt with the tokenizer's special tokens, the response followed by ``eos``):
the format ``sluice train`` then generates in. ``sft.train_on`` picks the trained tokens.

Every row a user can get wrong is one ``DatasetError`` naming the file and row: no assistant
turn, a template that drops an assistant turn's content, conversational rows without a chat
template, a row over ``sft.max_length`` (with ``long_rows: error``; ``filter`` drops and counts
it). It does not read files (``data/readers.py``) or train (``sft/``).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sluice.config.data import DataConfig
from sluice.config.sft import SftConfig
from sluice.data.chat import ChatRenderer, chat_messages
from sluice.data.mapping import has, lookup, require
from sluice.data.readers import DatasetError, RowSet

log = logging.getLogger(__name__)

TOO_LONG = "too_long"
"""The ``ExampleSet.filtered`` reason of rows over ``sft.max_length``."""
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class SftExample:
    """One row's tokens; ``train[i]`` is 1 when token ``i`` is predicted with loss (``train[0]``
    is always 0: the first token has no prefix)."""

    ids: tuple[int, ...]
    train: tuple[int, ...]
    where: str


@dataclass
class ExampleSet:
    """The examples of one split and the rows left out of it, per reason."""

    examples: list[SftExample] = field(default_factory=list)
    filtered: Counter[str] = field(default_factory=Counter)


def plain_tokens(tokenizer: Any, prompt: str, response: str, train_all: bool = False) -> tuple[list[int], list[int]]:
    """Ids of an untemplated prompt (with the tokenizer's special tokens), response and ``eos``,
    and the trained tokens: the response and ``eos`` (``train_all``: every token after the first)."""
    p = list(tokenizer(prompt)["input_ids"])
    r = [*tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    first = 1 if train_all else len(p)
    return p + r, [0] * first + [1] * (len(p) + len(r) - first)


class ConversationRenderer:
    """One run's row rendering (``data`` and ``sft`` sections, the model's tokenizer)."""

    def __init__(self, tokenizer: Any, data: DataConfig, sft: SftConfig, max_length: int) -> None:
        self.chat = ChatRenderer(tokenizer, data.chat_template, data.system_prompt)
        self.tokenizer = tokenizer
        self.data = data
        self.sft = sft
        self.max_length = max_length
        self.marked = bool(_GENERATION.search(str(getattr(tokenizer, "chat_template", None) or "")))

    def build(self, rows: RowSet) -> ExampleSet:
        """Every row's example; rows over ``max_length`` dropped and counted (``filter``) or refused."""
        out = ExampleSet()
        for k, row in enumerate(rows.rows):
            where = rows.where(k)
            example = self.example(row, where)
            if not any(example.train):
                raise DatasetError(f"{where}: no token to train on (sft.train_on: {self.sft.train_on!r})")
            if len(example.ids) <= self.max_length:
                out.examples.append(example)
                continue
            if self.sft.long_rows == "error":
                raise DatasetError(
                    f"{where}: {len(example.ids)} tokens, over sft.max_length ({self.max_length}); "
                    "shorten the row, raise sft.max_length, or set sft.long_rows=filter"
                )
            if not out.filtered[TOO_LONG]:
                log.warning(
                    "%s: %d tokens, over sft.max_length (%d): dropped", where, len(example.ids), self.max_length
                )
            out.filtered[TOO_LONG] += 1
        if out.filtered[TOO_LONG]:
            log.warning(
                "%s: %d of %d rows over sft.max_length dropped", rows.source, out.filtered[TOO_LONG], len(rows.rows)
            )
        return out

    def example(self, row: Any, where: str) -> SftExample:
        """One row's ids and loss tokens."""
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a mapping, got {type(row).__name__}")
        if has(row, self.sft.messages_key):
            key = self.sft.messages_key
            messages = chat_messages(lookup(row, key), where, key)
            return self._templated(messages, where, key)
        prompt = require(row, self.data.prompt_key, where, "prompt", "data.prompt_key")
        response = require(row, self.sft.response_key, where, "response", "sft.response_key")
        if isinstance(prompt, str) and isinstance(response, str) and not self.chat.templated:
            return self._plain(prompt, response, where)
        head = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else chat_messages(prompt, where, "prompt")
        )
        tail = (
            [{"role": "assistant", "content": response}]
            if isinstance(response, str)
            else chat_messages(response, where, self.sft.response_key)
        )
        return self._templated([*head, *tail], where, self.data.prompt_key)

    def _plain(self, prompt: str, response: str, where: str) -> SftExample:
        """Untemplated: ``prompt`` with the tokenizer's special tokens, ``response`` and ``eos``."""
        if not response:
            raise DatasetError(f"{where}: the response at {self.sft.response_key!r} is empty: nothing to train on")
        ids, train = plain_tokens(self.tokenizer, prompt, response, self.sft.train_on == "all")
        return SftExample(tuple(ids), tuple(train), where)

    def _templated(self, messages: list[dict[str, str]], where: str, key: str) -> SftExample:
        """A conversation (the system prompt put first) through the chat template."""
        if not self.chat.templated:
            raise DatasetError(
                f"{where}: chat messages at {key!r}, but the tokenizer has no chat template "
                f"(data.chat_template: {self.data.chat_template!r}); give the tokenizer one, or rows of "
                "prompt / completion strings"
            )
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns and self.sft.train_on != "all":
            roles = ", ".join(m["role"] for m in messages)
            raise DatasetError(f"{where}: no assistant turn to train on (roles: {roles})")
        if self.data.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.data.system_prompt}, *messages]
            turns = [k + 1 for k in turns]
        ids, spans = self._marked(messages, where) if self.marked else self._diffed(messages, turns, where)
        if self.sft.train_on == "completion":
            spans = spans[-1:]
        train = [0] * len(ids)
        if self.sft.train_on == "all":
            train = [0] + [1] * (len(ids) - 1)
        for start, stop in spans:
            train[max(start, 1) : stop] = [1] * (stop - max(start, 1))
        return SftExample(tuple(ids), tuple(train), where)

    def _render(self, messages: list[dict[str, str]], generation: bool = False) -> str:
        if not messages:
            return ""
        return str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False))

    def _diffed(
        self, messages: list[dict[str, str]], turns: list[int], where: str
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of the whole conversation and each assistant turn's token span, by prefix diffing."""
        text = self._render(messages)
        chars: list[tuple[int, int]] = []
        for k in turns:
            before, through = self._render(messages[:k], generation=True), self._render(messages[: k + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise DatasetError(
                    f"{where}: the chat template does not render this conversation turn by turn (assistant "
                    f"message {k + 1} changes what comes before it); give the template {{% generation %}} marks"
                )
            content = messages[k]["content"].strip()
            if content and content not in through[len(before) :]:
                raise DatasetError(
                    f"{where}: the chat template drops the content of assistant message {k + 1} "
                    f"({content!r:.40}); it cannot be trained on with this template"
                )
            chars.append((len(before), len(through)))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
        spans = []
        for lo, hi in chars:
            inside = [i for i, (s, e) in enumerate(offsets) if s < hi and e > lo]
            spans.append((inside[0], inside[-1] + 1) if inside else (0, 0))
        return ids, spans

    def _marked(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and assistant spans from the template's ``{% generation %}`` marks."""
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        spans = [(i, i) for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        spans = [(lo, next((j for j in range(lo, len(mask)) if not mask[j]), len(mask))) for lo, _ in spans]
        if not spans and self.sft.train_on != "all":
            raise DatasetError(f"{where}: the chat template's {{% generation %}} marks cover no assistant token")
        return ids, spans
