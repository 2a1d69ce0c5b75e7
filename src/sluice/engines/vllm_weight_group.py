"""Weights into vLLM's worker processes over the broadcast group (``fleet.weight_transfer: broadcast``).

Each vLLM worker process joins the trainer's weight broadcast group itself (gloo on CPU, NCCL
on CUDA; ``weights/wire.py``), as rank ``first_rank + its vLLM rank``: ``WeightGroupWorker`` is
vLLM's ``worker_extension_cls``, so its method is a plain ``collective_rpc`` by name with plain
arguments (no pickled callable). When the engine loads version ``v`` (``SegmentedEngine``: no
segment is running), every worker joins the group on its first load, receives and drops the
versions broadcast before ``v`` (every receiver takes part in every broadcast), receives ``v``
bucket by bucket straight into vLLM's layer-wise ``reload_weights`` (no worker holds a copy of
the whole model, nothing is written to a file) and returns the float64 sum of what it received,
the engine's checksum (docs/engines.md, "Weights over the broadcast group into vLLM's workers").

``GroupVersions`` is the engine side's ``WeightStager``: an update is only a version number (the
weights are already on their way from the trainer), and its checksum is the workers' answer.

Not here: the trainer's side (``weights/broadcast.py`` publishes), choosing ranks (the rollout
worker gives each engine its ``WorkerGroup``), surviving a dead trainer (the receive raises and
the engine fails every request: its weights are unknown).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.engines.weight_folder import DEFAULT_ROOT, EMBED, HEAD, WeightFolders
from sluice.weights.wire import (
    Layout,
    Ranges,
    bucket_layout,
    connect,
    receive_bucket,
    receive_header,
    resolve,
    unflatten,
)

EXTENSION = f"{__name__}.WeightGroupWorker"
"""vLLM's ``worker_extension_cls`` for an engine fed by the group."""

_MEMBERS: dict[tuple[str, int], tuple[Any, torch.device]] = {}
"""This worker process's process group per (address, rank): joined once, kept for the run."""


@dataclass
class GroupVersion:
    """A version the engine will load from the group; ``checksum`` is filled by the load."""

    version: int
    checksum: float | None = None


class GroupVersions:
    """``WeightStager`` of an engine whose workers receive updates from the group (module docstring);
    the untied start copy of a tied model is ``WeightFolders``'."""

    def __init__(self, model_dir: str | Path, root: str | Path = DEFAULT_ROOT, *, untie: bool = False) -> None:
        self._folders = WeightFolders(model_dir, root, untie=untie)
        self.model_dir = self._folders.model_dir
        self.untie, self.tied = self._folders.untie, self._folders.tied
        self.staged: dict[int, GroupVersion] = {}

    def serving_folder(self) -> Path:
        return self._folders.serving_folder()

    def write(self, weights: Mapping[str, torch.Tensor], version: int) -> GroupVersion:
        """Version ``version``, to be received by the workers when loaded (``weights`` is empty:
        the tensors travel from the trainer straight to the workers)."""
        if weights:
            raise ValueError("an engine fed by the weight broadcast group takes versions, not tensors")
        self.staged[version] = GroupVersion(version)
        return self.staged[version]

    def checksum(self, weights: Mapping[str, torch.Tensor]) -> float:
        return self._folders.checksum(weights)

    def staged_checksum(self, version: int) -> float:
        checksum = self.staged[version].checksum
        if checksum is None:
            raise RuntimeError(f"weights version {version} has not been received from the group")
        return checksum

    def release_older(self, version: int) -> None:
        for old in [v for v in self.staged if v < version]:
            del self.staged[old]

    def close(self) -> None:
        self.staged.clear()
        self._folders.close()


class WeightGroupWorker:
    """Mixed into each vLLM worker (``worker_extension_cls``); ``collective_rpc`` calls it by name."""

    def sluice_receive_weights(
        self, group: tuple[str, int, str, float, int], version: int, untie: bool, tied: bool
    ) -> float:
        """Receive version ``version`` from the group and load it bucket by bucket; the float64
        sum of what was received (module docstring)."""
        pg, device = _member(group, int(getattr(self, "rank", 0)))
        while True:
            got, layout, ranges = receive_header(pg, device)
            if got > version:
                raise RuntimeError(f"weights version {version} was asked for, the group sent {got} first")
            if got == version:
                break
            for start, end in ranges:  # a superseded version: received (every rank must), not loaded
                receive_bucket(pg, device, start, end)
        checksum = [0.0]
        weights = _received(pg, device, layout, ranges, untie=untie, tied=tied, checksum=checksum)
        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        for _ in weights:  # every bucket off the wire even if the loader stopped early
            pass
        return checksum[0]


def _member(group: tuple[str, int, str, float, int], worker_rank: int) -> tuple[Any, torch.device]:
    address, world_size, backend, timeout_s, first_rank = group
    rank = first_rank + worker_rank
    if (address, rank) not in _MEMBERS:
        _MEMBERS[(address, rank)] = (connect(address, world_size, rank, backend, timeout_s), resolve(backend)[1])
    return _MEMBERS[(address, rank)]


def _received(
    pg: Any, device: torch.device, layout: Layout, ranges: Ranges, *, untie: bool, tied: bool, checksum: list[float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each bucket's tensors as it arrives (aliases once; with ``untie`` the embedding also as
    ``lm_head.weight`` unless that comes as its own tensor), summing them into ``checksum``."""
    separate_head = any(name == HEAD for name, *_, nbytes in layout if nbytes) and not _aliased(layout, HEAD)
    for index, (start, end) in enumerate(ranges):
        part = bucket_layout(layout, ranges, index)
        bucket = receive_bucket(pg, device, start, end)
        seen: set[int] = set()
        for name, tensor in unflatten(part, bucket, start).items():
            offset = next(e[3] for e in part if e[0] == name)
            if offset in seen and tensor.numel():
                continue  # a tied alias: its source was just yielded
            seen.add(offset)
            if not (tied and name == HEAD):
                checksum[0] += float(tensor.double().sum())
            yield name, tensor
            if untie and name == EMBED and not separate_head:
                yield HEAD, tensor


def _aliased(layout: Layout, name: str) -> bool:
    """Whether ``name``'s bytes are another (earlier) entry's."""
    entry = next(e for e in layout if e[0] == name)
    return any(e[3] == entry[3] and e[4] == entry[4] for e in layout[: layout.index(entry)])
