"""Rows → validated, tokenised ``PromptItem`` s under one run's ``data`` rules, and the run's
start-up checks of its own data (prompt length against the model's context, an explicit response
cap and a chosen reward).

Each row is mapped (``data/mapping.py``), rendered (``data/chat.py``), tokenised and held to
``data.max_prompt_length``: a longer prompt is dropped and counted (``long_prompts: filter``, one
log line per file, the count in ``PromptSet.filtered``) or stops the run naming its row
(``error``). Every other bad row is one ``DatasetError`` naming it; nothing is skipped silently.
This module does not read files (``data/readers.py``) or order prompts (``data/stream.py``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.api import PromptItem
from sluice.config import ConfigError, SluiceConfig
from sluice.config.data import DataConfig
from sluice.data.chat import ChatRenderer
from sluice.data.mapping import map_row
from sluice.data.readers import DatasetError, RowSet, read_rows

log = logging.getLogger(__name__)

TOO_LONG = "too_long"
"""The ``PromptSet.filtered`` reason of prompts over ``data.max_prompt_length``."""


@dataclass
class PromptSet:
    """The prompts of one split and the rows left out of it, per reason."""

    items: list[PromptItem] = field(default_factory=list)
    filtered: Counter[str] = field(default_factory=Counter)

    def extend(self, other: PromptSet) -> None:
        self.items.extend(other.items)
        self.filtered.update(other.filtered)


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt in tokens, and where that number came from (said in every message)."""

    tokens: int
    origin: str = "data.max_prompt_length"

    def __str__(self) -> str:
        return f"{self.tokens} tokens, {self.origin}"


class PromptBuilder:
    """Turns rows into a ``PromptSet`` by the ``data`` section's mapping, chat and length rules;
    ``limit`` is the longest prompt (``None``: no limit)."""

    def __init__(self, data: DataConfig, tokenizer: Any, limit: PromptLimit | None = None) -> None:
        self.data = data
        self.tokenizer = tokenizer
        self.limit = limit
        self.renderer = ChatRenderer(tokenizer, data.chat_template, data.system_prompt)

    def read(self, files: Sequence[str]) -> PromptSet:
        """Every file's rows, in order; an item's ``index`` counts rows over all files (0-based)."""
        out = PromptSet()
        for path in files:
            out.extend(self.build(read_rows(path), start=len(out.items) + sum(out.filtered.values())))
        return out

    def build(self, rows: RowSet, *, keep_columns: bool = False, start: int = 0) -> PromptSet:
        """Validate and tokenise ``rows``; ``keep_columns`` passes every column to the reward."""
        out = PromptSet()
        unk = getattr(self.tokenizer, "unk_token_id", None)
        for k, row in enumerate(rows.rows):
            where = rows.where(k)
            prompt, fields = map_row(row, self.data, where, keep_columns)
            text = self.renderer.render(prompt, where, self.data.prompt_key)
            ids = self.renderer.encode(text)
            if unk is not None and unk in ids:
                raise DatasetError(f"{where}: the prompt has characters outside the tokenizer's vocabulary")
            if self.limit is not None and len(ids) > self.limit.tokens:
                if self.data.long_prompts == "error":
                    raise DatasetError(
                        f"{where}: the prompt is {len(ids)} tokens, over the prompt limit ({self.limit}); "
                        "data.long_prompts: filter drops such rows"
                    )
                out.filtered[TOO_LONG] += 1
                continue
            out.items.append(PromptItem(index=start + k, prompt=text, prompt_ids=ids, fields=fields))
        name = rows.source or f"the {rows.unit}s"
        if out.filtered[TOO_LONG]:
            log.warning(
                "%s: %d of %d prompts longer than the prompt limit (%s) filtered (data.long_prompts: filter)",
                name, out.filtered[TOO_LONG], len(rows.rows), self.limit,
            )  # fmt: skip
        if not rows.rows:
            raise DatasetError(f"dataset is empty: no rows in {name}")
        if not out.items:
            raise DatasetError(
                f"{name}: every prompt is longer than the prompt limit ({self.limit}); raise data.max_prompt_length "
                "or lower rollout.max_new_tokens, within the model's context"
            )
        return out


def model_context(model_dir: str | Path) -> int | None:
    """The model's ``max_position_embeddings`` from its ``config.json`` (``None`` if it has none)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True).get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def prompt_limit(data: DataConfig, model_dir: str | Path, max_new_tokens: int) -> PromptLimit | None:
    """The longest prompt allowed: ``data.max_prompt_length`` or the model's context minus the
    response cap. A limit that leaves no room for ``max_new_tokens`` is a ``ConfigError``."""
    context = model_context(model_dir)
    given = PromptLimit(data.max_prompt_length) if data.max_prompt_length is not None else None
    if context is None:
        return given
    limit = data.max_prompt_length if data.max_prompt_length is not None else context - max_new_tokens
    if limit < 1 or limit + max_new_tokens > context:
        shown = "null" if data.max_prompt_length is None else data.max_prompt_length
        raise ConfigError(
            f"data.max_prompt_length ({shown}) + rollout.max_new_tokens ({max_new_tokens}) must fit the model's "
            f"max_position_embeddings ({context}, {Path(model_dir) / 'config.json'})"
        )
    derived = f"the model's max_position_embeddings ({context}) - rollout.max_new_tokens ({max_new_tokens})"
    return given or PromptLimit(limit, derived)


def check_user_data(config: SluiceConfig, reward_given: bool, files: str = "data.train_files") -> None:
    """With the user's own rows (``files``: ``data.train_files``, or ``sluice eval --data``)
    nothing task-specific may be assumed: the response cap and the reward must be chosen explicitly."""
    if files == "data.train_files" and not config.data.train_files:
        return
    if config.rollout.max_new_tokens is None:
        raise ConfigError(
            f"rollout.max_new_tokens: must be set with {files} (the built-in task's cap does not apply to your data)"
        )
    reward = config.reward
    if not (reward.name or reward.fn or reward.by_source or reward_given):
        raise ConfigError(
            f"reward: {files} needs a reward: set reward.name, reward.fn or reward.by_source "
            "(or pass RLTrainer(reward=...))"
        )
