"""Weight sync over a torch.distributed broadcast group: trainer rank 0 pushes every version to
the engine processes as soon as it is published.

``BroadcastWeightSync`` implements ``WeightSync``. One object describes the group (``address``,
``receivers``); ``publisher()`` is the trainer's view (rank 0), ``receiver(rank)`` an engine
process's view (ranks ``1..receivers``).

- **publish** (rank 0) packs the state dict into one flat byte buffer on the group's device (one
  copy: later optimizer steps cannot change a published version; tied aliases are packed once)
  and returns; a sender thread broadcasts each version, in order, as a header, its layout and its
  bytes in buckets of ``bucket_bytes`` (``trainer.weight_bucket_mb``; ``wire.py``). The trainer
  never waits for the transfer, so it runs beside the next step (StreamRL's
  weight transfer off the critical path).
- **fetch** (ranks ≥ 1): a listener thread receives every broadcast as it comes and keeps the
  newest ``keep`` versions; ``fetch(v)`` waits until ``v`` has arrived and returns tensors viewing
  its buffer (a fresh buffer per version, so they stay valid while the caller holds them).
- The group is made directly on a ``TCPStore`` that rank 0 hosts at ``address`` (a
  ``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), never as the default group, so the
  trainer's data-parallel group and this one coexist. Each process keeps its endpoint in a
  module registry keyed by ``(address, rank)``: Ray pickles the sync object into every call, and
  every copy reaches the same group. Every receiver must take part in every broadcast.
- **engines()**: the rollout worker's view when its engines' own worker processes are the
  receivers (vLLM's workers join with ``WorkerGroup`` and load each bucket as it arrives,
  ``engines/vllm_weight_group.py``); then nothing passes through the rollout worker.

Not here: applying weights (``InferenceEngine.update_weights``), choosing a reachable address
on a multi-node cluster (``address`` must be on rank 0's node), surviving the publisher (a
receiver whose publisher died raises from ``fetch``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from sluice.weights.versions import NO_VERSION, check_keep, check_publish, missing_version
from sluice.weights.wire import (
    STOP,
    Layout,
    bucket_ranges,
    connect,
    flatten,
    receive_bucket,
    receive_header,
    resolve,
    send_stop,
    send_version,
    unflatten,
)

logger = logging.getLogger(__name__)

Backend = Literal["auto", "gloo", "nccl"]
DEFAULT_BUCKET_BYTES = 256 << 20  # trainer.weight_bucket_mb's default

__all__ = ["Backend", "BroadcastWeightSync", "EngineWorkersFeed", "WorkerGroup", "flatten", "unflatten"]


@dataclass(frozen=True)
class _Group:
    address: str  # tcp://host:port of rank 0's store
    world_size: int
    backend: Backend
    timeout_s: float
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class _Endpoint:
    """This process's member of one broadcast group: the store, the process group, its thread."""

    def __init__(self, group: _Group, rank: int, keep: int) -> None:
        self.group, self.rank, self.keep = group, rank, keep
        self.backend, self.device = resolve(group.backend)
        self.latest = NO_VERSION
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.error: BaseException | None = None
        self.changed = threading.Condition()
        self.outbox: queue.Queue[tuple[int, Layout, torch.Tensor]] = queue.Queue()
        self.spare: list[torch.Tensor] = []  # send buffers already broadcast, for the next publish
        target = self._send_loop if rank == 0 else self._receive_loop
        self.thread = threading.Thread(target=target, name=f"sluice-weights-r{rank}", daemon=True)
        self.thread.start()

    def _connect(self) -> Any:
        g = self.group
        return connect(g.address, g.world_size, self.rank, g.backend, g.timeout_s)

    def _send_loop(self) -> None:
        try:
            pg = self._connect()
            while True:
                version, layout, buffer = self.outbox.get()
                if version == STOP:
                    send_stop(pg, self.device)
                    return
                send_version(pg, self.device, version, layout, buffer, bucket_ranges(layout, self.group.bucket_bytes))
                self.spare[:] = [buffer]
        except BaseException as exc:  # fails the next publish instead of dying silently
            self._fail(exc)

    def _receive_loop(self) -> None:
        try:
            pg = self._connect()
            while True:
                version, layout, ranges = receive_header(pg, self.device)
                buffer = torch.empty(ranges[-1][1], dtype=torch.uint8, device=self.device)
                for start, end in ranges:
                    receive_bucket(pg, self.device, start, end, out=buffer[start:end])
                tensors = unflatten(layout, buffer)
                with self.changed:
                    self.versions[version] = tensors
                    self.latest = max(self.latest, version)
                    for old in sorted(self.versions)[: -self.keep]:
                        del self.versions[old]
                    self.changed.notify_all()
        except BaseException as exc:  # surfaces from the next fetch
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self.changed:
            self.error = exc
            self.changed.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight broadcast (rank {self.rank}) failed: {self.error!r}") from self.error


_ENDPOINTS: dict[tuple[str, int], _Endpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


class BroadcastWeightSync:
    """``WeightSync`` over a broadcast group (see the module docstring).

    ``address``: ``tcp://host:port`` on rank 0's node, free; ``receivers``: engine processes
    (ranks ``1..receivers``); ``backend``: ``gloo`` (CPU), ``nccl`` (CUDA) or ``auto`` (NCCL when
    CUDA is available); ``timeout_s``: how long a collective (the rendezvous included) may wait.
    """

    def __init__(
        self,
        address: str,
        receivers: int = 1,
        *,
        rank: int | None = None,
        keep: int = 2,
        backend: Backend = "auto",
        timeout_s: float = 1800.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if receivers < 1:
            raise ValueError(f"a broadcast group needs at least one receiver, got {receivers}")
        if rank is not None and not 0 <= rank <= receivers:
            raise ValueError(f"rank {rank} outside a group of 1 publisher and {receivers} receivers")
        resolve(backend)
        self.group = _Group(address, receivers + 1, backend, timeout_s, max(bucket_bytes, 1))
        self.rank = rank
        self.keep = check_keep(keep)

    def publisher(self) -> BroadcastWeightSync:
        """The trainer's view (rank 0): ``publish``."""
        return self._as(0)

    def receiver(self, rank: int = 1) -> BroadcastWeightSync:
        """An engine process's view (``rank`` in ``1..receivers``): ``fetch``."""
        if rank < 1:
            raise ValueError(f"receiver ranks start at 1, got {rank}")
        return self._as(rank)

    def engines(self) -> EngineWorkersFeed:
        """The rollout worker's view when its engines' own worker processes are the receivers
        (vLLM: ``engines/vllm_weight_group.py``)."""
        return EngineWorkersFeed(self.group)

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``named_tensors`` into one buffer and queue its broadcast as ``version``, bucket by
        bucket (``bucket_bytes``)."""
        endpoint = self._endpoint(0, "publish")
        endpoint.check()
        check_publish(version, endpoint.latest)
        spare = endpoint.spare.pop() if endpoint.spare else None
        layout, buffer = flatten(named_tensors, endpoint.device, spare)
        endpoint.latest = version
        endpoint.outbox.put((version, layout, buffer))

    def fetch(self, version: int) -> Mapping[str, torch.Tensor]:
        """The tensors of ``version``, waiting until its broadcast arrives (views of its buffer)."""
        endpoint = self._endpoint(self.rank or 0, "fetch")
        deadline = time.monotonic() + self.group.timeout_s
        with endpoint.changed:
            while version not in endpoint.versions:
                endpoint.check()
                if endpoint.latest > version:
                    raise missing_version(version, list(endpoint.versions), self.keep)
                if not endpoint.changed.wait(timeout=deadline - time.monotonic()):
                    raise TimeoutError(f"weights version {version} did not arrive in {self.group.timeout_s} s")
            return dict(endpoint.versions[version])

    def latest_version(self) -> int:
        """The newest version published (rank 0) or received (receivers) by this process."""
        return self._endpoint(self.rank or 0, "latest_version").latest

    def close(self) -> None:
        """Rank 0: tell the receivers the group is done (after the queued versions) and wait for
        the sender; receivers: wait for that message (a process must not exit mid-collective)."""
        endpoint = _ENDPOINTS.get((self.group.address, self.rank or 0))
        if endpoint is None:
            return
        if self.rank == 0:
            endpoint.outbox.put((STOP, [], torch.empty(0, dtype=torch.uint8)))
        endpoint.thread.join(timeout=self.group.timeout_s)

    def _as(self, rank: int) -> BroadcastWeightSync:
        view = BroadcastWeightSync.__new__(BroadcastWeightSync)
        view.group, view.rank, view.keep = self.group, rank, self.keep
        return view

    def _endpoint(self, rank: int, verb: str) -> _Endpoint:
        if self.rank is None or (verb != "latest_version" and (verb == "publish") != (self.rank == 0)):
            role = "publisher() (rank 0)" if verb == "publish" else "receiver(rank >= 1)"
            raise RuntimeError(f"{verb} needs the {role} view of the broadcast group, this is rank {self.rank}")
        with _ENDPOINTS_LOCK:
            key = (self.group.address, rank)
            if key not in _ENDPOINTS:
                _ENDPOINTS[key] = _Endpoint(self.group, rank, self.keep)
            return _ENDPOINTS[key]


@dataclass(frozen=True)
class WorkerGroup:
    """What an engine's worker processes need to join a broadcast group as ranks
    ``first_rank .. first_rank + ranks - 1`` (one per tensor-parallel worker): plain values, so
    they cross an engine's own RPC."""

    address: str
    world_size: int
    backend: str
    timeout_s: float
    first_rank: int

    def as_tuple(self) -> tuple[str, int, str, float, int]:
        return (self.address, self.world_size, self.backend, self.timeout_s, self.first_rank)


class EngineWorkersFeed:
    """``WeightSync`` of a rollout worker whose engines' workers receive every version from the
    group themselves, when their engine loads it: no tensor passes through the rollout worker, so
    ``fetch`` returns none (the engine's ``update_weights`` takes the version number only)."""

    def __init__(self, group: _Group) -> None:
        self.group = group

    def worker_group(self, first_rank: int) -> WorkerGroup:
        """The group as one engine's workers join it, from rank ``first_rank`` on."""
        g = self.group
        if not 1 <= first_rank < g.world_size:
            raise ValueError(f"receiver rank {first_rank} outside a group of {g.world_size - 1} receivers")
        return WorkerGroup(g.address, g.world_size, g.backend, g.timeout_s, first_rank)

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        raise RuntimeError("the engines' view of a broadcast group receives; trainer rank 0 publishes")

    def fetch(self, version: int) -> Mapping[str, torch.Tensor]:
        return {}

    def latest_version(self) -> int:
        return NO_VERSION
