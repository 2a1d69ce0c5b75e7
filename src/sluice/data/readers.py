"""Read a dataset path into rows (plain dicts): JSONL, JSON, parquet, ``datasets`` folders.

Every problem with a file is one ``DatasetError`` naming the file and the 1-based line (JSONL) or
row: a missing file, an unknown format, bytes that are not UTF-8, bad JSON, a row that is not an
object. Parquet files and ``Dataset.save_to_disk`` folders are read by pyarrow / ``datasets``;
JSONL keeps a line-by-line reader so its errors name the line. This module does not interpret the
rows (``data/mapping.py`` does) or tokenise anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.config.loading import read_utf8


class DatasetError(ValueError):
    """A malformed dataset file or row; the message names the file and the 1-based line or row."""


@dataclass(frozen=True)
class RowSet:
    """The rows of one source and where each came from, for messages: ``where(k)`` of row ``k``
    (0-based) reads ``"train.jsonl line 7"`` or ``"train.parquet row 3"``."""

    source: str
    rows: list[dict[str, Any]]
    numbers: list[int] = field(default_factory=list)
    """1-based line (JSONL) or row number of each row; empty: ``k + 1``."""
    unit: str = "row"

    def where(self, k: int) -> str:
        number = self.numbers[k] if self.numbers else k + 1
        return f"{self.source} {self.unit} {number}" if self.source else f"{self.unit} {number}"


def in_memory(rows: list[dict[str, Any]], unit: str = "row") -> RowSet:
    """Rows given in Python; messages name them ``"{unit} N"`` (e.g. ``"held-out row 3"``)."""
    return RowSet("", rows, unit=unit)


def read_rows(path: str | Path) -> RowSet:
    """One file or folder's rows, by format: ``.jsonl``, ``.json`` (a list of objects),
    ``.parquet``, or a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
    (its ``train`` split; name a split's own folder, ``FOLDER/test``, to read another)."""
    p = Path(path)
    if p.is_dir():
        return _read_saved_dataset(p)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(p)
    if suffix == ".json":
        return _read_json(p)
    if suffix == ".parquet":
        return _read_parquet(p)
    raise DatasetError(f"{p}: unknown format {suffix or '(no suffix)'!r}: expected .jsonl, .json, .parquet or a folder")


def read_jsonl(path: str | Path) -> RowSet:
    """A JSONL file, one object per line (blank lines skipped); errors name the 1-based line."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    rows, numbers = [], []
    for lineno, raw in enumerate(p.read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DatasetError(
                f"{p} line {lineno}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1})"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{p} line {lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{p} line {lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        numbers.append(lineno)
    return RowSet(str(p), rows, numbers, unit="line")


def _read_json(p: Path) -> RowSet:
    text = read_utf8(p, DatasetError)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{p} line {err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(rows, list):
        raise DatasetError(f"{p}: expected a JSON list of row objects, got {type(rows).__name__}")
    for k, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{p} row {k + 1}: expected a JSON object, got {type(row).__name__}")
    return RowSet(str(p), rows)


def _read_parquet(p: Path) -> RowSet:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{p}: not a readable parquet file ({err})") from None
    return RowSet(str(p), table.to_pylist())


def _read_saved_dataset(p: Path) -> RowSet:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(p))
    except FileNotFoundError:
        raise DatasetError(f"{p}: a folder, but not one written by datasets' save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if "train" not in loaded:
            raise DatasetError(
                f"{p}: a DatasetDict without a 'train' split (splits: {', '.join(splits)}); "
                f"name one split's folder, e.g. {p / splits[0]}"
            )
        loaded, p = loaded["train"], p / "train"
    return RowSet(str(p), loaded.to_list())
