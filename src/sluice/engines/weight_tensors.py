"""``WeightTensors``: weight updates staged in memory, for an engine that loads them from tensors.

The in-memory counterpart of ``WeightFolders`` (``weight_folder.py``), with the same methods, so
``SegmentedEngine`` drives either. ``write`` copies a version's weights (tied aliases once, a
tied model's ``lm_head.weight`` added as a copy of the embedding when the engine serves it
untied) into one ``SharedWeights`` block: anonymous shared memory (``memfd_create``), which has
no path (nothing under ``/dev/shm`` or anywhere else) and which an engine process on this
machine maps through ``/proc/<pid>/fd/<fd>`` (``SharedHandle``: a few hundred bytes to send
instead of the tensors). A version's block is released once a newer version is loaded, and
the last released block is refilled by the next version of the same shapes. The only folder
is the untied copy of a tied model that the engine starts from (``serving_folder``).

Linux only (memfd). It does not move anything to the engine: the engine's backend sends the
handle (vLLM: ``reload_weights(weights_iterator=...)`` in each worker, ``vllm_engine.py``).
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.engines.weight_folder import DEFAULT_ROOT, WeightFolders, serving_tensors

_ALIGN = 64  # every tensor starts on a cache line
Layout = tuple[tuple[str, str, tuple[int, ...], int], ...]
"""Each tensor of a block as (name, dtype, shape, byte offset)."""


@dataclass(frozen=True)
class SharedHandle:
    """What an engine process needs to map a ``SharedWeights`` block: picklable and small."""

    pid: int
    fd: int
    name: str
    size: int
    layout: Layout

    def open(self) -> list[tuple[str, torch.Tensor]]:
        """Map the block (copy-on-write: the sender's bytes stay as they are) and view each tensor;
        refuses a descriptor that is no longer this block (its owner closed it)."""
        link = f"/proc/{self.pid}/fd/{self.fd}"
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            target = None
        if target != f"/memfd:{self.name} (deleted)":
            raise RuntimeError(f"shared weights {self.name!r}: {link} no longer refers to them")
        with open(link, "rb") as f:
            block = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY)
        data = torch.frombuffer(block, dtype=torch.uint8)
        return [(name, _view(data, dtype, shape, offset)) for name, dtype, shape, offset in self.layout]


class SharedWeights:
    """One version's tensors, packed into an anonymous shared-memory block owned by this process."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.layout, size = _layout(tensors)
        self.name = f"sluice-weights-{os.getpid()}-{secrets.token_hex(4)}"
        self.fd = os.memfd_create(self.name)
        self.size = max(size, 1)
        os.ftruncate(self.fd, self.size)
        self._block = mmap.mmap(self.fd, self.size)
        data = torch.frombuffer(self._block, dtype=torch.uint8)
        self.items = [(name, _view(data, dtype, shape, offset)) for name, dtype, shape, offset in self.layout]
        self.fill(tensors)
        self.handle = SharedHandle(os.getpid(), self.fd, self.name, self.size, self.layout)

    def fill(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (this block's layout) in: a block is reused once no engine reads it,
        which skips the page faults of fresh shared memory (3-4x the copy itself, measured)."""
        with torch.no_grad():
            for (_, view), t in zip(self.items, tensors.values(), strict=True):
                view.copy_(t)

    def close(self) -> None:
        """Release the descriptor; the memory goes once the last view of it is gone."""
        self.items = []
        os.close(self.fd)


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[Layout, int]:
    """Each tensor's (name, dtype, shape, byte offset) in a block, and the block's size."""
    layout, size = [], 0
    for name, t in tensors.items():
        layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), size))
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return tuple(layout), size


def _view(data: torch.Tensor, dtype: str, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    dt = getattr(torch, dtype)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dt).element_size()
    return data[offset : offset + nbytes].view(dt).reshape(shape)


class WeightTensors:
    """Stages versions as ``SharedWeights`` blocks; frees superseded ones, keeping the last freed
    block to refill with the next version of the same shapes."""

    def __init__(self, model_dir: str | Path, root: str | Path = DEFAULT_ROOT, *, untie: bool = False) -> None:
        self._folders = WeightFolders(model_dir, root, untie=untie)  # the serving folder and checksum rules
        self.model_dir = self._folders.model_dir
        self.staged: dict[int, SharedWeights] = {}
        self._spare: SharedWeights | None = None

    def serving_folder(self) -> Path:
        """The folder the engine starts from (``WeightFolders.serving_folder``)."""
        return self._folders.serving_folder()

    def write(self, weights: Mapping[str, torch.Tensor], version: int) -> SharedWeights:
        """Copy ``weights`` (names as in the HF ``state_dict``) into version ``version``'s block."""
        if version in self.staged:
            self._free(self.staged.pop(version))
        tensors = serving_tensors(weights, self._folders.untie)
        shared, self._spare = self._spare, None
        if shared is not None and shared.layout == _layout(tensors)[0]:
            shared.fill(tensors)
        else:
            if shared is not None:
                shared.close()
            shared = SharedWeights(tensors)
        self.staged[version] = shared
        return shared

    def checksum(self, weights: Mapping[str, torch.Tensor]) -> float:
        return self._folders.checksum(weights)

    def staged_checksum(self, version: int) -> float:
        """``checksum`` of version ``version``'s block."""
        return self.checksum(dict(self.staged[version].items))

    def release_older(self, version: int) -> None:
        """Free the blocks of versions below ``version`` (loaded or superseded)."""
        for old in [v for v in self.staged if v < version]:
            self._free(self.staged.pop(old))

    def close(self) -> None:
        for shared in [*self.staged.values(), *([self._spare] if self._spare else [])]:
            shared.close()
        self.staged.clear()
        self._spare = None
        self._folders.close()

    def _free(self, shared: SharedWeights) -> None:
        """Keep ``shared`` as the spare block (closing the previous spare)."""
        if self._spare is not None:
            self._spare.close()
        self._spare = shared
