"""Map one raw row onto a prompt and the fields its reward gets, by the ``data`` section's keys.

Keys are dotted paths into nested rows (``reward_model.ground_truth``; a number steps into a
list: ``prompt.0.content``), so verl's parquet schema (``data_source``, ``prompt`` as chat
messages, ``ability``, ``reward_model: {style, ground_truth}``, ``extra_info``) reads with the
defaults. The fields are ``answer`` (numbers become strings), ``data_source`` (``"default"`` when
the row has none) and every ``data.fields`` name. A missing path is one ``DatasetError`` naming
the row and the path. Rendering and tokenising the prompt are ``data/chat.py``'s job.
"""

from __future__ import annotations

import difflib
from typing import Any

from sluice.config.data import DataConfig
from sluice.data.readers import DatasetError

DEFAULT_SOURCE = "default"
ANSWER_PATHS = ("answer", "reward_model.ground_truth")
"""Where the answer is looked for, in order, when ``data.answer_key`` is null."""

_MISSING = object()


def lookup(row: dict[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` of ``row``, or ``_MISSING``."""
    node: Any = row
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def has(row: dict[str, Any], path: str) -> bool:
    """Whether ``row`` holds a value at the dotted ``path``."""
    return lookup(row, path) is not _MISSING


LIKELY_COLUMNS = {
    "data.prompt_key": ("prompt", "question", "problem", "query", "instruction", "input", "messages", "text"),
    "data.answer_key": ("answer", "solution", "ground_truth", "target", "label", "output", "response"),
}
"""Column names rows commonly hold the prompt and the answer under, likeliest first."""


def require(row: dict[str, Any], path: str, where: str, what: str, key: str) -> Any:
    """The value at ``path``; a missing one names the config ``key`` to set and the likeliest column."""
    value = lookup(row, path)
    if value is _MISSING:
        guess = _likely_column(row, path, key)
        fix = f"; set {key}={guess}" if guess else f"; set {key} to one of them"
        raise DatasetError(f"{where}: no {what} at {path!r} (row keys: {', '.join(map(str, row)) or 'none'}){fix}")
    return value


def _likely_column(row: dict[str, Any], path: str, key: str) -> str | None:
    """The row's column most likely meant: a common name for it, else the closest spelling."""
    columns = [str(c) for c in row]
    common = next((c for c in LIKELY_COLUMNS.get(key, ()) if c in columns and c != path), None)
    return common or next(iter(difflib.get_close_matches(path, columns, n=1, cutoff=0.6)), None)


def map_row(row: Any, data: DataConfig, where: str, keep_columns: bool = False) -> tuple[Any, dict[str, Any]]:
    """(the raw prompt, the reward's fields) of one row. ``keep_columns`` also passes every other
    top-level column through (the built-in tasks' rows, whose columns are their reward's and
    environment's arguments)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a mapping with a {data.prompt_key!r} field, got {type(row).__name__}")
    prompt = require(row, data.prompt_key, where, "prompt", "data.prompt_key")
    fields = {k: v for k, v in row.items() if k != data.prompt_key} if keep_columns else {}
    answer_path, answer = _answer(row, data, where)
    fields["answer"] = as_answer(answer, where, answer_path)
    source = lookup(row, data.data_source_key)
    fields["data_source"] = DEFAULT_SOURCE if source is _MISSING or source is None else str(source)
    for name, path in data.fields.items():
        fields[name] = require(row, path, where, f"field {name!r}", f"data.fields.{name}")
    return prompt, fields


def _answer(row: dict[str, Any], data: DataConfig, where: str) -> tuple[str, Any]:
    if data.answer_key is not None:
        return data.answer_key, require(row, data.answer_key, where, "answer", "data.answer_key")
    for path in ANSWER_PATHS:
        value = lookup(row, path)
        if value is not _MISSING:
            return path, value
    guess = _likely_column(row, "answer", "data.answer_key")
    raise DatasetError(
        f"{where}: no answer: neither {' nor '.join(map(repr, ANSWER_PATHS))} is in the row "
        f"(row keys: {', '.join(map(str, row)) or 'none'}); set data.answer_key{'=' + guess if guess else ''}"
    )


def as_answer(value: Any, where: str, path: str) -> str:
    """A reference answer as the string rewards compare: numbers are written out (an integral
    float as an integer: ``72.0`` → ``"72"``); anything else but a string is an error."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    raise DatasetError(
        f"{where}: the answer at {path!r} must be a string or a number, got {type(value).__name__} {value!r}"
    )
