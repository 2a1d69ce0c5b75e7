"""Storage units of the TransferQueue: rows × columns in memory, plus row placement helpers.

``InMemoryStorageUnit`` keeps variable-length numeric columns (token ids, log-probs, given as
lists, tuples or 1-D tensors) without padding: each put of such a column is one ``PackedColumn``
(flat buffer ``[total_tokens]`` plus offsets ``[rows + 1]``), kept as received, and a row is a
slice of it. Anything else (scalars, strings, dicts, 2-D tensors) is kept as the object itself. A
buffer is freed when all its rows are dropped; dropped indices are remembered (``FreedRows``) and
later writes to them are ignored. Reads of packed columns return one ``PackedColumn`` (the rows
gathered into one new buffer), so bytes, not per-row objects, cross process boundaries; clients
pack puts the same way and merge the units' reads (``merge_reads``). Rows live in blocks of 64
consecutive indices dealt round-robin over the units (``unit_of``), so every client can compute a
row's place without asking, and a small put or get of neighbouring rows talks to one unit.

It deliberately does not know tasks, readiness or consumption (controllers do), does no
locking (the client serialises calls; on Ray the actor does), imports torch only to materialise
a tensor row (a storage actor never needs to), and does not spill to disk.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from sluice.api.queue import Partition, RowMeta
from sluice.queue.lifecycle import FreedRows
from sluice.queue.packed import (
    META_FIELDS,
    PARTITION_FIELD,
    Allocator,
    MetaRows,
    PackedColumn,
    gather,
    meta_array,
)

__all__ = ["InMemoryStorageUnit", "PackedColumn"]

logger = logging.getLogger(__name__)


def _read_cells(
    packed: dict[int, tuple[PackedColumn, int]],
    objects: dict[int, Any],
    indices: Sequence[int],
    alloc: Allocator | None,
) -> Sequence[Any]:
    """The rows as one ``PackedColumn`` if all are packed alike (possibly from several puts), else a list."""
    if indices and all(i in packed for i in indices):
        cells = [packed[i] for i in indices]
        first = cells[0][0]
        if all(c.compatible(first) for c in {id(c): c for c, _ in cells}.values()):
            return gather(cells, first, alloc)
    return [objects[i] if i in objects else packed[i][0][packed[i][1]] for i in indices]


class InMemoryStorageUnit:
    """Rows × columns in this process's memory (implements ``sluice.api.queue.StorageUnit``).

    Per row it keeps the meta as a plain tuple and, per packed column, ``(buffer, position)``:
    a write of n rows makes no per-row object in Python code (``dict.update`` over ``zip``)."""

    def __init__(self, num_units: int = 1) -> None:
        self._meta: dict[int, tuple[int, ...]] = {}  # row -> RowMeta fields
        self._packed: dict[str, dict[int, tuple[PackedColumn, int]]] = {}
        self._objects: dict[str, dict[int, Any]] = {}  # cells that are not packed rows
        self._freed = FreedRows(num_units, PLACEMENT_BLOCK)  # this unit holds every num_units-th block
        self.late_writes = 0  # rows written after they were freed, ignored

    def write(
        self, indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None = None
    ) -> MetaRows:
        """Store ``columns[name][k]`` as row ``indices[k]``; a new row without meta gets a default one.

        Rows freed earlier are skipped (counted in ``late_writes``); returns the written rows' metas.
        """
        check_aligned(indices, columns, meta)
        live = [pos for pos, i in enumerate(indices) if i not in self._freed] if self._freed.num_ranges else None
        if live is not None and len(live) < len(indices):
            self.late_writes += len(indices) - len(live)
            indices = [indices[p] for p in live]
            meta = None if meta is None else MetaRows(meta_array(meta)).take(live)
            columns = {name: _take(values, live) for name, values in columns.items()}
        metas = self._write_meta(indices, meta)
        for name, values in columns.items():
            packed = PackedColumn.from_rows(values)
            cells, objects = self._packed.setdefault(name, {}), self._objects.setdefault(name, {})
            if packed is None:
                objects.update(zip(indices, values, strict=True))
                for i in indices if cells else ():
                    cells.pop(i, None)
            else:
                cells.update(zip(indices, zip(repeat(packed), range(len(indices))), strict=True))
                for i in indices if objects else ():
                    objects.pop(i, None)
        return metas

    def _write_meta(self, indices: Sequence[int], meta: Sequence[RowMeta] | None) -> MetaRows:
        """Record the rows' metas (given, kept, or a default for a new row) and return them."""
        if meta is not None:
            array = meta_array(meta)
            self._meta.update(zip(indices, map(tuple, array.tolist()), strict=True))
            return MetaRows(array)
        new = [i for i in indices if i not in self._meta]
        self._meta.update(zip(new, map(tuple, default_metas(new).tolist()), strict=True))
        return MetaRows(np.array([self._meta[i] for i in indices], dtype=np.int64).reshape(-1, META_FIELDS))

    def read(
        self, indices: Sequence[int], columns: Sequence[str], alloc: Allocator | None = None
    ) -> dict[str, Sequence[Any]]:
        """Column-level read; packed columns come back packed (``PackedColumn``, gathered into
        ``alloc``'s buffer when it gives one), others as lists."""
        out: dict[str, Sequence[Any]] = {}
        for name in columns:
            packed, objects = self._packed.get(name, {}), self._objects.get(name, {})
            try:
                out[name] = _read_cells(packed, objects, indices, alloc) if indices else []
            except KeyError:
                missing = [i for i in indices if i not in packed and i not in objects]
                raise KeyError(f"rows {missing[:8]} have no column {name!r}") from None
        return out

    def drop(self, indices: Sequence[int]) -> int:
        """Forget the rows and remember them as freed (later writes to them are ignored)."""
        dropped = 0
        for i in indices:
            if self._meta.pop(i, None) is not None:
                dropped += 1
            for cells in (*self._packed.values(), *self._objects.values()):
                cells.pop(i, None)
        self._freed.add(indices)
        return dropped

    def _columns_of(self) -> dict[int, list[str]]:
        names: dict[int, list[str]] = {i: [] for i in self._meta}
        for table in (self._packed, self._objects):
            for name, cells in table.items():
                for i in cells:
                    names[i].append(name)
        return names

    def catalog(self) -> list[tuple[RowMeta, tuple[str, ...]]]:
        return [(RowMeta(*self._meta[i]), tuple(sorted(cols))) for i, cols in self._columns_of().items()]

    def snapshot(self) -> dict[str, Any]:
        """``{"meta": [row tuples], "columns": {name: {"indices", "values"}}, "freed": [indices]}``.

        ``values`` are as ``read`` returns them; ``merge_snapshots`` turns them into plain lists.
        ``freed`` lists the freed row indices (compact in memory, explicit in a checkpoint).
        """
        columns = {}
        for name in dict.fromkeys([*self._packed, *self._objects]):
            indices = [*self._packed.get(name, {}), *self._objects.get(name, {})]
            if indices:
                columns[name] = {"indices": indices, "values": self.read(indices, [name])[name]}
        meta = [list(m) for m in self._meta.values()]
        return {"meta": meta, "columns": columns, "freed": self._freed.indices()}

    def restore(self, state: dict[str, Any]) -> None:
        meta = [RowMeta(*row) for row in state["meta"]]
        self.write([m.index for m in meta], {}, meta)
        for name, col in state["columns"].items():
            self.write(col["indices"], {name: col["values"]})
        self._freed.add(state.get("freed", []))

    def stats(self) -> dict[str, Any]:
        chunks = {id(c): c for cells in self._packed.values() for c, _ in cells.values()}
        counts: dict[str, int] = {}
        for table in (self._packed, self._objects):
            for name, cells in table.items():
                counts[name] = counts.get(name, 0) + len(cells)
        return {
            "rows": len(self._meta),
            "columns": counts,
            "packed_bytes": sum(c.nbytes for c in chunks.values()),
            "freed_ranges": self._freed.num_ranges,
            "late_writes": self.late_writes,
        }


def default_metas(indices: Sequence[int]) -> np.ndarray:
    """``metas_to_array`` of the default metas of new rows (own group, version 0, no partition)."""
    array = np.zeros((len(indices), META_FIELDS), dtype=np.int64)
    array[:, 0] = array[:, 1] = indices
    array[:, 4] = 1  # group_size
    array[:, PARTITION_FIELD] = -1
    return array


def check_aligned(indices: Sequence[int], columns: Mapping[str, Sequence[Any]], meta: Sequence[RowMeta] | None) -> None:
    """Every column and ``meta`` has one entry per index (``meta[k].index == indices[k]``)."""
    for name, values in columns.items():
        if len(values) != len(indices):
            raise ValueError(f"column {name!r} has {len(values)} values for {len(indices)} rows")
    if meta is not None and (len(meta) != len(indices) or meta_indices(meta) != list(indices)):
        raise ValueError("meta must be aligned with indices (meta[k].index == indices[k])")


def meta_indices(meta: Sequence[RowMeta]) -> list[int]:
    return meta.indices() if isinstance(meta, MetaRows) else [m.index for m in meta]


def _take(values: Sequence[Any], positions: Sequence[int]) -> list[Any]:
    return [values[p] for p in positions]


PLACEMENT_BLOCK = 64
"""Rows stored together on one unit: a put or get of neighbouring rows (a producer's chunk, a GRPO
group, a micro-batch) talks to one unit instead of all, while many blocks spread over the units."""


def unit_of(index: int, num_units: int) -> int:
    """The storage unit of row ``index``: blocks of ``PLACEMENT_BLOCK`` rows, dealt round-robin."""
    return (index // PLACEMENT_BLOCK) % num_units


def placement(indices: Sequence[int], num_units: int) -> dict[int, list[int]]:
    """Positions in ``indices`` per storage unit (``unit_of``)."""
    if not indices:
        return {}
    if num_units == 1:
        return {0: list(range(len(indices)))}
    out: dict[int, list[int]] = {}
    for pos, i in enumerate(indices):
        out.setdefault((i // PLACEMENT_BLOCK) % num_units, []).append(pos)
    return out


def select_rows(
    columns: Mapping[str, Sequence[Any]], positions: Sequence[int], pack: bool = False, alloc: Allocator | None = None
) -> dict[str, Sequence[Any]]:
    """The sub-columns at ``positions`` (one storage unit's share of a put), packed if asked and
    possible (into ``alloc``'s buffers when it gives them)."""
    out: dict[str, Sequence[Any]] = {}
    for name, values in columns.items():
        whole = len(positions) == len(values)  # positions ascend without repeats: all rows, in order
        if isinstance(values, PackedColumn) and pack:
            out[name] = values if whole else gather([(values, p) for p in positions], values, alloc)
            continue
        rows = values if whole else [values[p] for p in positions]
        out[name] = (PackedColumn.from_rows(rows, alloc) or list(rows)) if pack else list(rows)
    return out


def merge_reads(
    parts: Mapping[int, Mapping[str, Sequence[Any]]], positions: Mapping[int, list[int]], columns: Sequence[str], n: int
) -> dict[str, Sequence[Any]]:
    """Per-unit reads as columns aligned with the original ``n`` rows; packed parts stay packed."""
    out: dict[str, Sequence[Any]] = {}
    for name in columns:
        pieces = [part[name] for part in parts.values()]
        if len(parts) == 1:
            (unit,) = parts
            if positions[unit] == list(range(n)):
                out[name] = pieces[0]
                continue
        packed = [p for p in pieces if isinstance(p, PackedColumn)]
        if packed and len(packed) == len(pieces) and all(p.compatible(packed[0]) for p in packed):
            at: list[Any] = [None] * n
            for unit, part in parts.items():
                col = part[name]
                for k, p in enumerate(positions[unit]):
                    at[p] = (col, k)
            out[name] = gather(at, packed[0])
            continue
        target: list[Any] = [None] * n
        for unit, part in parts.items():
            for p, v in zip(positions[unit], part[name], strict=True):
                target[p] = v
        out[name] = target
    return out


def group_by_columns(catalog: Sequence[tuple[RowMeta, tuple[str, ...]]]) -> dict[tuple[str, ...], list[RowMeta]]:
    """Rows of a ``catalog`` grouped by the columns they hold (one notification per group)."""
    groups: dict[tuple[str, ...], list[RowMeta]] = {}
    for meta, names in catalog:
        groups.setdefault(names, []).append(meta)
    return groups


def with_partition(indices: Sequence[int], meta: Sequence[RowMeta] | None, part: Partition) -> MetaRows:
    """The put's row metas, made members of ``part`` (rows without meta get a default one)."""
    if part.expected_rows < 0:
        raise ValueError(f"partition {part.id}: expected_rows must be >= 0, got {part.expected_rows}")
    array = default_metas(indices) if meta is None else meta_array(meta).copy()
    array[:, PARTITION_FIELD] = part.id
    return MetaRows(array)


def merge_snapshots(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One unit-independent, plain-data storage state from the states of all units."""
    merged: dict[str, Any] = {"meta": [], "columns": {}, "freed": []}
    for state in states:
        merged["meta"].extend(state["meta"])
        merged["freed"].extend(state.get("freed", []))
        for name, col in state["columns"].items():
            dst = merged["columns"].setdefault(name, {"indices": [], "values": []})
            dst["indices"].extend(col["indices"])
            dst["values"].extend(col["values"])  # materialises a PackedColumn's rows
    return merged


def split_snapshot(state: dict[str, Any], num_units: int) -> list[dict[str, Any]]:
    """The inverse of ``merge_snapshots`` for ``num_units`` units (which may differ), packed for the wire."""
    parts: list[dict[str, Any]] = [{"meta": [], "columns": {}, "freed": []} for _ in range(num_units)]
    for i in state.get("freed", []):
        parts[unit_of(i, num_units)]["freed"].append(i)
    for row in state["meta"]:
        parts[unit_of(row[0], num_units)]["meta"].append(row)
    for name, col in state["columns"].items():
        for i, v in zip(col["indices"], col["values"], strict=True):
            dst = parts[unit_of(i, num_units)]["columns"].setdefault(name, {"indices": [], "values": []})
            dst["indices"].append(i)
            dst["values"].append(v)
    for part in parts:
        for col in part["columns"].values():
            col["values"] = PackedColumn.from_rows(col["values"]) or col["values"]
    return parts
