"""``PackedColumn``: a column of variable-length numeric rows as one flat buffer plus offsets.

The TransferQueue's padding-free, columnar wire and storage format (AsyncFlow §3.5): a put packs
each such column once per storage unit, a unit stores the buffer as received and gathers the
requested rows into one new buffer per read, and the client merges the units' buffers into one
column in batch order. No per-row object crosses a process boundary; a row becomes a Python
object only when it is accessed. Plain numpy, so a storage actor never imports torch.

It deliberately does not handle nested or 2-D rows (those stay Python objects in a list).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any, overload

import numpy as np

from sluice.api.queue import RowMeta


def _equal_rows(self: Sequence[Any], other: object) -> bool:
    """Row-wise equality with any sequence (the ``__eq__`` of the queue's lazy row containers)."""
    if not isinstance(other, Sequence) or isinstance(other, str):
        return NotImplemented
    return len(self) == len(other) and list(self) == list(other)


class PackedColumn(Sequence[Any]):
    """Variable-length numeric rows without padding: one flat buffer plus offsets.

    Row ``k`` is ``values[offsets[k]:offsets[k + 1]]``, materialised on access as it came in: a
    ``list`` / ``tuple`` of Python numbers (``values`` int64 or float64, offsets in elements) or a
    1-D tensor of torch dtype ``dtype`` (``values`` are its raw bytes, offsets in bytes, so a
    process can hold, slice and ship it without importing torch). Pickles as two numpy arrays.
    Compares equal to any sequence with equal rows.
    """

    __slots__ = ("dtype", "kind", "offsets", "values")

    def __init__(self, values: np.ndarray, offsets: np.ndarray, kind: str, dtype: str = "") -> None:
        self.values = values  # [total elements] or [total bytes]
        self.offsets = offsets  # int64 [rows + 1]
        self.kind = kind  # "list" | "tuple" | "tensor"
        self.dtype = dtype  # torch dtype name for "tensor", else ""

    @staticmethod
    def from_rows(rows: Sequence[Any], alloc: Allocator | None = None) -> PackedColumn | None:
        """The packed form of ``rows``, or ``None`` if they are not 1-D numeric rows of one kind;
        tensor rows are concatenated straight into ``alloc``'s buffer when it gives one."""
        if isinstance(rows, PackedColumn):
            return rows
        if not rows:
            return None
        return _pack_sequences(rows) or _pack_tensors(rows, alloc)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, k: int) -> Any: ...

    @overload
    def __getitem__(self, k: slice) -> list[Any]: ...

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            start, stop, step = k.indices(len(self))
            if step == 1 and self.kind == "tensor":
                return self._tensor_rows(start, max(start, stop))
            return [self[i] for i in range(start, stop, step)]
        n = len(self)
        if not -n <= k < n:
            raise IndexError(f"row {k} of a {n}-row column")
        k %= n
        part = self.values[int(self.offsets[k]) : int(self.offsets[k + 1])]
        if self.kind == "list":
            return part.tolist()
        if self.kind == "tuple":
            return tuple(part.tolist())
        import torch

        dtype = getattr(torch, self.dtype)
        return torch.from_numpy(part.copy()).view(dtype) if len(part) else torch.empty(0, dtype=dtype)

    def __iter__(self) -> Iterator[Any]:
        if self.kind == "tensor":
            return iter(self._tensor_rows(0, len(self)))
        return (self[k] for k in range(len(self)))

    def _tensor_rows(self, start: int, stop: int) -> list[Any]:
        """Rows ``start:stop`` as tensors: one copy of their bytes, split into views of it (each
        row owns a disjoint part of a fresh buffer; per-row copies cost ~10 us of Python each)."""
        import torch

        dtype = getattr(torch, self.dtype)
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        flat = torch.from_numpy(self.values[a:b].copy()).view(dtype) if b > a else torch.empty(0, dtype=dtype)
        return list(torch.split(flat, (np.diff(self.offsets[start : stop + 1]) // dtype.itemsize).tolist()))

    __eq__ = _equal_rows
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedColumn({len(self)} rows, {self.kind}{'/' + self.dtype if self.dtype else ''}, {self.nbytes} B)"

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)

    def lengths(self) -> np.ndarray:
        """``[rows]`` row lengths (elements, or bytes for tensor rows)."""
        return np.diff(self.offsets)

    def compatible(self, other: PackedColumn) -> bool:
        return (self.kind, self.dtype, self.values.dtype) == (other.kind, other.dtype, other.values.dtype)


def offsets_of(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[rows + 1]`` int64 offsets of rows with these lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


Allocator = Callable[[int], "np.ndarray | None"]
"""``nbytes -> uint8 buffer`` to gather into (e.g. a shared-memory slot), or ``None``: a fresh array."""


def gather(
    pieces: Sequence[tuple[PackedColumn, int]], like: PackedColumn, alloc: Allocator | None = None
) -> PackedColumn:
    """One new ``PackedColumn`` of the rows ``(column, position)``, in order (all compatible with ``like``);
    its buffer comes from ``alloc`` when that gives one. Neighbouring rows of one column are copied
    as one slice (a put's rows are read back in runs, so a 1024-row read is a few copies)."""
    if not pieces:
        return PackedColumn(like.values[:0], offsets_of([]), like.kind, like.dtype)
    parts: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    k = 0
    while k < len(pieces):
        col, start = pieces[k]
        end = start + 1
        while k + end - start < len(pieces):
            nxt_col, nxt = pieces[k + end - start]
            if nxt_col is not col or nxt != end:  # identity: equal rows of another buffer are not a run
                break
            end += 1
        bounds = col.offsets[start : end + 1]
        parts.append(col.values[int(bounds[0]) : int(bounds[-1])])
        lengths.append(np.diff(bounds))
        k += end - start
    offsets = offsets_of(np.concatenate(lengths))
    raw = alloc(int(offsets[-1]) * like.values.itemsize) if alloc is not None else None
    if raw is None:
        return PackedColumn(np.concatenate(parts), offsets, like.kind, like.dtype)
    values = raw.view(like.values.dtype)
    np.concatenate(parts, out=values)
    return PackedColumn(values, offsets, like.kind, like.dtype)


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
    return PackedColumn(buf, offsets_of([len(v) for v in rows]), kind.__name__)


def _pack_tensors(rows: Sequence[Any], alloc: Allocator | None) -> PackedColumn | None:
    torch = sys.modules.get("torch")  # a tensor can only be here if torch is loaded
    if torch is None:
        return None
    tensor, dtype = torch.Tensor, getattr(rows[0], "dtype", None)
    if not all(isinstance(v, tensor) and v.dim() == 1 and v.dtype == dtype for v in rows):
        return None
    if not all(v.is_cpu and not v.requires_grad for v in rows):
        rows = [v.detach().cpu() for v in rows]
    itemsize = rows[0].element_size()
    offsets = offsets_of(np.fromiter(map(tensor.numel, rows), dtype=np.int64, count=len(rows)) * itemsize)
    nbytes = int(offsets[-1])
    raw = alloc(nbytes) if alloc is not None and nbytes else None
    if raw is not None:  # no fresh pages to fault in, no second copy to send it
        torch.cat(rows, out=torch.from_numpy(raw).view(dtype))
    elif nbytes:
        raw = torch.cat(rows).view(torch.uint8).numpy()  # fresh: its numpy view shares nothing
    else:
        raw = np.zeros(0, dtype=np.uint8)
    return PackedColumn(raw, offsets, "tensor", str(dtype)[6:])


META_FIELDS = 6
PARTITION_FIELD = 5  # column of ``RowMeta.partition`` in a ``metas_to_array`` array
"""Columns of ``metas_to_array``: the fields of ``RowMeta`` in order."""


def metas_to_array(metas: Sequence[RowMeta]) -> np.ndarray:
    """``[rows, 6]`` int64 array of ``RowMeta`` s: one buffer on the wire instead of one object per row
    (unpickling a thousand small objects costs milliseconds)."""
    if not metas:
        return np.zeros((0, META_FIELDS), dtype=np.int64)
    return np.array(
        [(m.index, m.group_id, m.version, m.num_tokens, m.group_size, m.partition) for m in metas], dtype=np.int64
    )


def array_to_metas(rows: np.ndarray) -> list[RowMeta]:
    """The inverse of ``metas_to_array``."""
    return [RowMeta(*r) for r in rows.tolist()]


def meta_array(metas: Sequence[RowMeta]) -> np.ndarray:
    """``metas_to_array``, free for a ``MetaRows``."""
    return metas.array if isinstance(metas, MetaRows) else metas_to_array(metas)


class MetaRows(Sequence[RowMeta]):
    """Row metas kept as one ``metas_to_array`` array; a ``RowMeta`` is made when a row is accessed.

    What a Ray ``get`` returns as ``Batch.meta`` and what storage units store and notify: making a
    thousand ``RowMeta`` objects costs about a millisecond, which a caller that only needs the
    indices or forwards the metas never pays. Compares equal to any sequence with equal metas.
    """

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array  # int64 [rows, META_FIELDS]

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, k: int) -> RowMeta: ...

    @overload
    def __getitem__(self, k: slice) -> MetaRows: ...

    def __getitem__(self, k: int | slice) -> RowMeta | MetaRows:
        if isinstance(k, slice):
            return MetaRows(self.array[k])
        return RowMeta(*self.array[k].tolist())

    def __iter__(self) -> Iterator[RowMeta]:
        return iter(array_to_metas(self.array))

    def indices(self) -> list[int]:
        return self.array[:, 0].tolist()

    def take(self, positions: Sequence[int]) -> MetaRows:
        return MetaRows(self.array[list(positions)])

    __eq__ = _equal_rows
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MetaRows({len(self)} rows)"
