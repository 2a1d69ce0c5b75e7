"""Same-node bulk transport of the Ray backend: reusable shared-memory arenas.

On one node the bytes of a packed column need not go through Ray's object store (a fresh object
per call: allocation, page faults, two copies). Each process that sends bytes owns one
``Arena``: a ``/dev/shm`` segment mapped once (pages faulted in up front) and reused as a ring of
slots. A sender copies a buffer into a slot and sends an ``ShmSlice`` (segment name, offset,
length, dtype) in the Ray message instead of the buffer; the receiver maps the segment once
(``attach``, cached) and copies the bytes out; then the slot is freed (after the put's
acknowledgement, or by a ``release`` message after a read). A buffer that does not fit a free
slot simply travels the ordinary Ray way, so a full arena never blocks.

Segments are named ``sluice-arena-<pid>-<n>``; ``close`` unlinks them, and a new arena first
removes those of processes that no longer exist (a killed actor cannot clean up after itself).
It deliberately does not cross nodes: callers compare node ids before using it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.queue.packed import PackedColumn

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "sluice-arena-"
DEFAULT_CAPACITY = 64 * 1024**2
MIN_BYTES = 128 * 1024
"""Smaller buffers travel inside the Ray message: a slot and its release cost more than the copy."""
_counter = itertools.count()


@dataclass(frozen=True)
class ShmSlice:
    """``nbytes`` bytes at ``offset`` of segment ``name``, to be read as ``dtype``; ``slot`` frees them."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    slot: int


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


def remove_stale_segments() -> int:
    """Unlink arenas whose owning process is gone; returns how many."""
    removed = 0
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        if not name.startswith(PREFIX):
            continue
        pid = int(name[len(PREFIX) :].split("-")[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
        except PermissionError:  # someone else's live process
            continue
    return removed


class Arena:
    """A shared-memory segment owned by this process, handed out as a ring of slots (thread-safe)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        remove_stale_segments()
        self.name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.capacity = capacity
        self._map = _map(os.path.join(SHM_DIR, self.name), capacity, create=True)
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)
        self._lock = threading.Lock()
        self._live: deque[list[int]] = deque()  # [slot, offset, end, freed] in allocation order
        self._slots = itertools.count()
        self._by_slot: dict[int, list[int]] = {}
        self._starts: dict[int, int] = {}  # offset -> slot of buffers handed out by ``buffer_for``

    def allocate(self, nbytes: int) -> tuple[int, int] | None:
        """``(slot, offset)`` of ``nbytes`` free bytes, or ``None`` if no contiguous room is free now."""
        nbytes = max(8, (nbytes + 63) // 64 * 64)  # cache-line aligned starts
        with self._lock:
            while self._live and self._live[0][3]:  # reclaim the freed prefix
                self._by_slot.pop(self._live.popleft()[0])
            if not self._live:
                start = 0
            else:
                head, tail = self._live[0][1], self._live[-1][2]
                if self._live[-1][1] >= head:  # live region is [head, tail): room after tail, else before head
                    start = tail if tail + nbytes <= self.capacity else 0
                    if start == 0 and nbytes > head:
                        return None
                else:  # wrapped: live region is [head, capacity) + [0, tail)
                    start = tail
                    if tail + nbytes > head:
                        return None
            if start + nbytes > self.capacity:
                return None
            entry = [next(self._slots), start, start + nbytes, 0]
            self._live.append(entry)
            self._by_slot[entry[0]] = entry
            return entry[0], start

    def put(self, values: np.ndarray) -> ShmSlice | None:
        """Copy ``values`` (1-D) into a slot; ``None`` if the arena has no room for it now."""
        got = self.allocate(values.nbytes)
        if got is None:
            return None
        slot, offset = got
        self.buffer[offset : offset + values.nbytes] = values.view(np.uint8)
        return ShmSlice(self.name, offset, values.nbytes, values.dtype.str, slot)

    def buffer_for(self, nbytes: int) -> np.ndarray | None:
        """A slot of ``nbytes`` to write into directly (an ``Allocator``); ``None`` if small or no room."""
        got = self.allocate(nbytes) if nbytes >= MIN_BYTES else None
        if got is None:
            return None
        self._starts[got[1]] = got[0]
        return self.buffer[got[1] : got[1] + nbytes]

    def slice_of(self, values: np.ndarray) -> ShmSlice | None:
        """The ``ShmSlice`` of a buffer that ``buffer_for`` gave out (``None`` for any other array)."""
        offset = values.__array_interface__["data"][0] - self.buffer.__array_interface__["data"][0]
        slot = self._starts.pop(offset, None) if 0 <= offset < self.capacity else None
        return None if slot is None else ShmSlice(self.name, offset, values.nbytes, values.dtype.str, slot)

    def free(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                entry = self._by_slot.get(slot)
                if entry is not None:
                    entry[3] = 1

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))


_attached: dict[str, np.ndarray] = {}
_attach_lock = threading.Lock()


def attach(name: str) -> np.ndarray:
    """The whole segment ``name`` as uint8, mapped once per process."""
    with _attach_lock:
        buf = _attached.get(name)
        if buf is None:
            path = os.path.join(SHM_DIR, name)
            buf = _attached[name] = np.frombuffer(_map(path, os.path.getsize(path), create=False), dtype=np.uint8)
        return buf


def view(piece: ShmSlice) -> np.ndarray:
    """The slice's bytes as ``dtype``, without copying (valid until the slot is freed)."""
    raw = attach(piece.name)[piece.offset : piece.offset + piece.nbytes]
    return raw.view(np.dtype(piece.dtype))


@dataclass(frozen=True)
class ShmPacked:
    """A ``PackedColumn`` whose values wait in an arena slot (what crosses the Ray call instead)."""

    values: ShmSlice
    offsets: np.ndarray
    kind: str
    dtype: str


_outbox: Arena | None = None
_outbox_lock = threading.Lock()


def outbox() -> Arena:
    """This process's sending arena (created on first use, unlinked at exit)."""
    global _outbox
    with _outbox_lock:
        if _outbox is None:
            import atexit

            _outbox = Arena()
            atexit.register(_outbox.close)
        return _outbox


def to_wire(columns: dict[str, Any], arena: Arena) -> tuple[dict[str, Any], list[int]]:
    """Move the packed columns' buffers into ``arena`` slots (those that fit); returns the slots used."""
    out: dict[str, Any] = {}
    slots = []
    for name, col in columns.items():
        big = isinstance(col, PackedColumn) and col.values.nbytes >= MIN_BYTES
        piece = (arena.slice_of(col.values) or arena.put(col.values)) if big else None
        if piece is None:
            out[name] = col
            continue
        out[name] = ShmPacked(piece, col.offsets, col.kind, col.dtype)
        slots.append(piece.slot)
    return out, slots


def from_wire(columns: Mapping[str, Any], copy: bool) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Columns as ``PackedColumn`` s again (viewing the arena unless ``copy``); slots to free per segment."""
    out: dict[str, Any] = {}
    slots: dict[str, list[int]] = {}
    for name, col in columns.items():
        if not isinstance(col, ShmPacked):
            out[name] = col
            continue
        values = view(col.values)
        out[name] = PackedColumn(values.copy() if copy else values, col.offsets, col.kind, col.dtype)
        slots.setdefault(col.values.name, []).append(col.values.slot)
    return out, slots
