"""Storage units of the TransferQueue: rows × columns in memory, plus row placement helpers.

``InMemoryStorageUnit`` keeps variable-length numeric columns (token ids, log-probs, given as
lists, tuples or 1-D tensors) without padding: each put of such a column becomes one flat buffer
``[total_tokens]`` plus offsets ``[rows + 1]``, and a row is a slice of it. Anything else (scalars,
strings, dicts, 2-D tensors) is kept as the object itself. A buffer is freed when all its rows are
dropped. Reads of packed columns return a ``PackedColumn`` (the rows gathered into one new
buffer), so bytes, not per-row objects, cross process boundaries; clients pack puts the same
way. Rows live on unit ``index % num_units`` (``partition``), so every client can compute a
row's place without asking anyone.

It deliberately does not know tasks, readiness or consumption (controllers do), does no
locking (the client serialises calls; on Ray the actor does), imports torch only to materialise
a tensor row (a storage actor never needs to), and does not spill to disk.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import astuple
from itertools import chain
from typing import Any, overload

import numpy as np

from sluice.api.queue import RowMeta

logger = logging.getLogger(__name__)


class PackedColumn(Sequence[Any]):
    """Variable-length numeric rows without padding: one flat buffer plus offsets.

    Row ``k`` is ``values[offsets[k]:offsets[k + 1]]``, materialised on access as it came in: a
    ``list`` / ``tuple`` of Python numbers (``values`` int64 or float64, offsets in elements) or a
    1-D tensor of torch dtype ``dtype`` (``values`` are its raw bytes, offsets in bytes, so a
    process can hold, slice and ship it without importing torch). Pickles as two numpy arrays.
    """

    __slots__ = ("dtype", "kind", "offsets", "values")

    def __init__(self, values: np.ndarray, offsets: np.ndarray, kind: str, dtype: str = "") -> None:
        self.values = values  # [total elements] or [total bytes]
        self.offsets = offsets  # int64 [rows + 1]
        self.kind = kind  # "list" | "tuple" | "tensor"
        self.dtype = dtype  # torch dtype name for "tensor", else ""

    @staticmethod
    def from_rows(rows: Sequence[Any]) -> PackedColumn | None:
        """The packed form of ``rows``, or ``None`` if they are not 1-D numeric rows of one kind."""
        if isinstance(rows, PackedColumn):
            return rows
        if not rows:
            return None
        return _pack_sequences(rows) or _pack_tensors(rows)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, k: int) -> Any: ...

    @overload
    def __getitem__(self, k: slice) -> list[Any]: ...

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        part = self.values[int(self.offsets[k]) : int(self.offsets[k + 1])]
        if self.kind == "list":
            return part.tolist()
        if self.kind == "tuple":
            return tuple(part.tolist())
        import torch

        dtype = getattr(torch, self.dtype)
        return torch.from_numpy(part.copy()).view(dtype) if len(part) else torch.empty(0, dtype=dtype)

    def __iter__(self) -> Iterator[Any]:
        return (self[k] for k in range(len(self)))

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _pack_sequences(rows: Sequence[Any]) -> PackedColumn | None:
    kind = type(rows[0])
    if kind not in (list, tuple) or any(type(v) is not kind for v in rows):
        return None
    flat = list(chain.from_iterable(rows))
    if flat and type(flat[0]) not in (int, float):
        return None
    try:
        buf = np.asarray(flat) if flat else np.zeros(0, dtype=np.int64)
    except (ValueError, TypeError):  # ragged nested rows: keep them as objects
        return None
    if buf.ndim != 1 or buf.dtype.kind not in "if":
        return None
    return PackedColumn(buf, _offsets([len(v) for v in rows]), kind.__name__)


def _pack_tensors(rows: Sequence[Any]) -> PackedColumn | None:
    torch = sys.modules.get("torch")  # a tensor can only be here if torch is loaded
    if torch is None:
        return None
    dtype = getattr(rows[0], "dtype", None)
    if not all(isinstance(v, torch.Tensor) and v.dim() == 1 and v.dtype == dtype for v in rows):
        return None
    flat = torch.cat([v.detach().cpu() for v in rows])
    raw = flat.view(torch.uint8).numpy().copy() if flat.numel() else np.zeros(0, dtype=np.uint8)
    return PackedColumn(raw, _offsets([v.numel() * v.element_size() for v in rows]), "tensor", str(dtype)[6:])


class _Slot:
    """A cell that lives inside a ``PackedColumn``."""

    __slots__ = ("column", "pos")

    def __init__(self, column: PackedColumn, pos: int) -> None:
        self.column = column
        self.pos = pos


def _gather(cells: list[Any]) -> Sequence[Any]:
    """Packed cells (possibly from several puts) as one ``PackedColumn`` if they agree, else rows."""
    if not all(type(c) is _Slot for c in cells):
        return [c.column[c.pos] if type(c) is _Slot else c for c in cells]
    first = cells[0].column
    if any(
        (c.column.kind, c.column.dtype, c.column.values.dtype) != (first.kind, first.dtype, first.values.dtype)
        for c in cells
    ):
        return [c.column[c.pos] for c in cells]
    parts = [c.column.values[int(c.column.offsets[c.pos]) : int(c.column.offsets[c.pos + 1])] for c in cells]
    return PackedColumn(np.concatenate(parts), _offsets([len(p) for p in parts]), first.kind, first.dtype)


class InMemoryStorageUnit:
    """Rows × columns in this process's memory (implements ``sluice.api.queue.StorageUnit``)."""

    def __init__(self) -> None:
        self._meta: dict[int, RowMeta] = {}
        self._cells: dict[str, dict[int, Any]] = {}

    def write(
        self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None = None
    ) -> list[RowMeta]:
        """Store ``columns[name][k]`` as row ``indices[k]``; a new row without meta gets a default one."""
        for name, values in columns.items():
            if len(values) != len(indices):
                raise ValueError(f"column {name!r} has {len(values)} values for {len(indices)} rows")
        if meta is not None:
            if len(meta) != len(indices) or any(m.index != i for m, i in zip(meta, indices, strict=True)):
                raise ValueError("meta must be aligned with indices (meta[k].index == indices[k])")
            self._meta.update(zip(indices, meta, strict=True))
        for i in indices:
            if i not in self._meta:
                self._meta[i] = RowMeta(index=i, group_id=i, version=0, num_tokens=0)
        for name, values in columns.items():
            cells = self._cells.setdefault(name, {})
            packed = PackedColumn.from_rows(values)
            if packed is None:
                cells.update(zip(indices, values, strict=True))
            else:
                cells.update((i, _Slot(packed, pos)) for pos, i in enumerate(indices))
        return [self._meta[i] for i in indices]

    def read(self, indices: Sequence[int], columns: Sequence[str]) -> dict[str, Sequence[Any]]:
        """Column-level read; packed columns come back packed (``PackedColumn``), others as lists."""
        out: dict[str, Sequence[Any]] = {}
        for name in columns:
            cells = self._cells.get(name, {})
            missing = [i for i in indices if i not in cells]
            if missing:
                raise KeyError(f"rows {missing[:8]} have no column {name!r}")
            out[name] = _gather([cells[i] for i in indices]) if indices else []
        return out

    def drop(self, indices: Sequence[int]) -> int:
        dropped = 0
        for i in indices:
            if self._meta.pop(i, None) is not None:
                dropped += 1
            for cells in self._cells.values():
                cells.pop(i, None)
        return dropped

    def catalog(self) -> list[tuple[RowMeta, tuple[str, ...]]]:
        names: dict[int, list[str]] = {i: [] for i in self._meta}
        for name, cells in self._cells.items():
            for i in cells:
                names[i].append(name)
        return [(self._meta[i], tuple(cols)) for i, cols in names.items()]

    def snapshot(self) -> dict[str, Any]:
        """``{"meta": [row tuples], "columns": {name: {"indices": [...], "values": ...}}}``.

        ``values`` are as ``read`` returns them; ``merge_snapshots`` turns them into plain lists.
        """
        columns = {}
        for name, cells in self._cells.items():
            indices = list(cells)
            columns[name] = {"indices": indices, "values": self.read(indices, [name])[name]}
        return {"meta": [list(astuple(m)) for m in self._meta.values()], "columns": columns}

    def restore(self, state: dict[str, Any]) -> None:
        meta = [RowMeta(*row) for row in state["meta"]]
        self.write([m.index for m in meta], {}, meta)
        for name, col in state["columns"].items():
            self.write(col["indices"], {name: col["values"]})

    def stats(self) -> dict[str, Any]:
        chunks = {id(c.column): c.column for cells in self._cells.values() for c in cells.values() if type(c) is _Slot}
        return {
            "rows": len(self._meta),
            "columns": {name: len(cells) for name, cells in self._cells.items()},
            "packed_bytes": sum(c.nbytes for c in chunks.values()),
        }


def partition(indices: Sequence[int], num_units: int) -> dict[int, list[int]]:
    """Positions in ``indices`` per storage unit (unit of row ``i`` is ``i % num_units``)."""
    if not indices:
        return {}
    if num_units == 1:
        return {0: list(range(len(indices)))}
    out: dict[int, list[int]] = {}
    for pos, i in enumerate(indices):
        out.setdefault(i % num_units, []).append(pos)
    return out


def select_rows(
    columns: Mapping[str, Sequence[Any]], positions: Sequence[int], pack: bool = False
) -> dict[str, Sequence[Any]]:
    """The sub-columns at ``positions`` (one storage unit's share of a put), packed if asked and possible."""
    out: dict[str, Sequence[Any]] = {}
    for name, values in columns.items():
        rows = [values[p] for p in positions]
        out[name] = (PackedColumn.from_rows(rows) or rows) if pack else rows
    return out


def scatter_back(
    parts: Mapping[int, Mapping[str, Sequence[Any]]], positions: Mapping[int, list[int]], columns: Sequence[str], n: int
) -> dict[str, list[Any]]:
    """Reassemble per-unit reads into columns aligned with the original ``n`` indices."""
    out: dict[str, list[Any]] = {name: [None] * n for name in columns}
    for unit, part in parts.items():
        for name in columns:
            target, values = out[name], part[name]
            for p, v in zip(positions[unit], values, strict=True):
                target[p] = v
    return out


def group_by_columns(catalog: Sequence[tuple[RowMeta, tuple[str, ...]]]) -> dict[tuple[str, ...], list[RowMeta]]:
    """Rows of a ``catalog`` grouped by the columns they hold (one notification per group)."""
    groups: dict[tuple[str, ...], list[RowMeta]] = {}
    for meta, names in catalog:
        groups.setdefault(names, []).append(meta)
    return groups


def merge_snapshots(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One unit-independent, plain-data storage state from the states of all units."""
    merged: dict[str, Any] = {"meta": [], "columns": {}}
    for state in states:
        merged["meta"].extend(state["meta"])
        for name, col in state["columns"].items():
            dst = merged["columns"].setdefault(name, {"indices": [], "values": []})
            dst["indices"].extend(col["indices"])
            dst["values"].extend(col["values"])  # materialises a PackedColumn's rows
    return merged


def split_snapshot(state: dict[str, Any], num_units: int) -> list[dict[str, Any]]:
    """The inverse of ``merge_snapshots`` for ``num_units`` units (which may differ), packed for the wire."""
    parts: list[dict[str, Any]] = [{"meta": [], "columns": {}} for _ in range(num_units)]
    for row in state["meta"]:
        parts[row[0] % num_units]["meta"].append(row)
    for name, col in state["columns"].items():
        for i, v in zip(col["indices"], col["values"], strict=True):
            dst = parts[i % num_units]["columns"].setdefault(name, {"indices": [], "values": []})
            dst["indices"].append(i)
            dst["values"].append(v)
    for part in parts:
        for col in part["columns"].values():
            col["values"] = PackedColumn.from_rows(col["values"]) or col["values"]
    return parts
