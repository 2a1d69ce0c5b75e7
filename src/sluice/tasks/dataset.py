"""Prompt datasets: validate raw rows (dicts) into tokenised ``PromptItem`` s.

Every bad row fails with one ``DatasetError`` naming the row and the field; nothing is skipped
silently. It does not generate data (tasks do) or decide the order prompts are used in
(``PromptStream`` below only cycles them deterministically by seed).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sluice.api import PromptItem


class DatasetError(ValueError):
    """A malformed dataset row or file; the message names the row and field."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file of rows; a line that is not a JSON object is an error naming the line."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    rows = []
    for lineno, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{p}:{lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def to_prompt_items(
    rows: Iterable[dict[str, Any]], tokenizer: Any, required: Sequence[str] = ("answer",), source: str = "row"
) -> list[PromptItem]:
    """Validate and tokenise rows; each needs a non-empty string ``prompt`` and the ``required`` fields."""
    items = []
    for i, row in enumerate(rows):
        where = f"{source} {i}"
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a mapping with a 'prompt' field, got {type(row).__name__}")
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DatasetError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r}")
        missing = [f for f in required if f not in row or row[f] is None]
        if missing:
            raise DatasetError(f"{where}: missing field(s) {', '.join(repr(f) for f in missing)}")
        ids = tuple(tokenizer(prompt)["input_ids"])
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None and unk in ids:
            raise DatasetError(f"{where}: field 'prompt' has characters outside the tokenizer's vocabulary")
        fields = {k: v for k, v in row.items() if k != "prompt"}
        items.append(PromptItem(index=i, prompt=prompt, prompt_ids=ids, fields=fields))
    if not items:
        raise DatasetError(f"dataset is empty: no {source}s")
    return items


class PromptStream:
    """Cycles through prompts in epochs, each epoch shuffled by ``(seed, epoch)``."""

    def __init__(self, items: Sequence[PromptItem], seed: int) -> None:
        self.items = list(items)
        self.seed = seed
        self.position = 0
        self._epoch = -1
        self._order: list[int] = []

    def take(self, count: int) -> list[PromptItem]:
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, len(self.items))
            if epoch != self._epoch:
                self._order = list(range(len(self.items)))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            out.append(self.items[self._order[offset]])
            self.position += 1
        return out
