"""Weight sync over a torch.distributed broadcast group: trainer rank 0 pushes every version to
the engine processes as soon as it is published.

``BroadcastWeightSync`` implements ``WeightSync``. One object describes the group (``address``,
``receivers``); ``publisher()`` is the trainer's view (rank 0), ``receiver(rank)`` an engine
process's view (ranks ``1..receivers``).

- **publish** (rank 0) packs the state dict into one flat byte buffer on the group's device (one
  copy: later optimizer steps cannot change a published version; tied aliases are packed once)
  and returns; a sender thread broadcasts each version, in order, as a header, its layout and its
  bytes. The trainer never waits for the transfer, so it runs beside the next step (StreamRL's
  weight transfer off the critical path).
- **fetch** (ranks ≥ 1): a listener thread receives every broadcast as it comes and keeps the
  newest ``keep`` versions; ``fetch(v)`` waits until ``v`` has arrived and returns tensors viewing
  its buffer (a fresh buffer per version, so they stay valid while the caller holds them).
- The group is made directly on a ``TCPStore`` that rank 0 hosts at ``address`` (a
  ``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), never as the default group, so the
  trainer's data-parallel group and this one coexist. Each process keeps its endpoint in a
  module registry keyed by ``(address, rank)``: Ray pickles the sync object into every call, and
  every copy reaches the same group. Every receiver must take part in every broadcast.

Not here: applying weights (``InferenceEngine.update_weights``), choosing a reachable address
on a multi-node cluster (``address`` must be on rank 0's node), surviving the publisher (a
receiver whose publisher died raises from ``fetch``).
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from sluice.weights.local import NO_VERSION, check_keep, check_publish, missing_version

logger = logging.getLogger(__name__)

Backend = Literal["auto", "gloo", "nccl"]
_STOP = -2  # header version that tells receivers the publisher closed
Layout = list[tuple[str, str, tuple[int, ...], int, int]]  # name, dtype, shape, byte offset, bytes


def flatten(
    named_tensors: Mapping[str, torch.Tensor], device: torch.device, spare: torch.Tensor | None = None
) -> tuple[Layout, torch.Tensor]:
    """One ``uint8`` buffer on ``device`` holding every tensor's bytes (tensors sharing storage,
    shape and dtype, like tied embeddings, once), and the layout that reads them back. ``spare``
    is reused when it has the right size (a fresh buffer costs its page faults: ~3x the copy)."""
    layout: Layout = []
    seen: dict[tuple[int, str, tuple[int, ...]], tuple[int, int]] = {}
    parts: list[torch.Tensor] = []
    offset = 0
    for name, t in named_tensors.items():
        dtype, shape = str(t.dtype).removeprefix("torch."), tuple(t.shape)
        key = (t.data_ptr(), dtype, shape)
        if key not in seen:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            seen[key] = (offset, raw.numel())
            parts.append(raw)
            offset += raw.numel()
        layout.append((name, dtype, shape, *seen[key]))
    fits = spare is not None and spare.numel() == offset and spare.device == device
    buffer = spare if fits and spare is not None else torch.empty(offset, dtype=torch.uint8, device=device)
    at = 0
    for raw in parts:
        buffer[at : at + raw.numel()].copy_(raw)
        at += raw.numel()
    return layout, buffer


def unflatten(layout: Layout, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer`` as ``flatten`` laid it out (no copy)."""
    out = {}
    for name, dtype, shape, offset, nbytes in layout:
        raw = buffer[offset : offset + nbytes]
        kind = getattr(torch, dtype)
        out[name] = raw.view(kind).reshape(shape) if nbytes else torch.empty(shape, dtype=kind)
    return out


def _resolve(backend: Backend) -> tuple[str, torch.device]:
    name = backend if backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if name not in ("gloo", "nccl"):
        raise ValueError(f"weight broadcast backend must be auto, gloo or nccl, got {backend!r}")
    return name, torch.device("cuda", torch.cuda.current_device()) if name == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class _Group:
    address: str  # tcp://host:port of rank 0's store
    world_size: int
    backend: Backend
    timeout_s: float


class _Endpoint:
    """This process's member of one broadcast group: the store, the process group, its thread."""

    def __init__(self, group: _Group, rank: int, keep: int) -> None:
        self.group, self.rank, self.keep = group, rank, keep
        self.backend, self.device = _resolve(group.backend)
        self.timeout = timedelta(seconds=group.timeout_s)
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
        url = urlparse(self.group.address)
        assert url.hostname is not None and url.port is not None, f"bad address {self.group.address!r}"
        store = dist.TCPStore(
            url.hostname, url.port, self.group.world_size, self.rank == 0, self.timeout, wait_for_workers=False
        )
        prefixed = dist.PrefixStore("sluice-weights", store)
        if self.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL  # only in CUDA builds

            return ProcessGroupNCCL(prefixed, self.rank, self.group.world_size, ProcessGroupNCCL.Options())
        return dist.ProcessGroupGloo(prefixed, self.rank, self.group.world_size, self.timeout)

    def _send_loop(self) -> None:
        try:
            pg = self._connect()
            while True:
                version, layout, buffer = self.outbox.get()
                meta = torch.frombuffer(bytearray(pickle.dumps(layout)), dtype=torch.uint8)
                header = torch.tensor([version, meta.numel(), buffer.numel()], dtype=torch.int64)
                pg.broadcast(header.to(self.device), 0).wait()
                if version == _STOP:
                    return
                pg.broadcast(meta.to(self.device), 0).wait()
                pg.broadcast(buffer, 0).wait()
                self.spare[:] = [buffer]
        except BaseException as exc:  # fails the next publish instead of dying silently
            self._fail(exc)

    def _receive_loop(self) -> None:
        try:
            pg = self._connect()
            while True:
                header = torch.zeros(3, dtype=torch.int64, device=self.device)
                pg.broadcast(header, 0).wait()
                version, meta_bytes, nbytes = header.tolist()
                if version == _STOP:
                    raise ConnectionError("the weight publisher closed the broadcast group")
                meta = torch.empty(meta_bytes, dtype=torch.uint8, device=self.device)
                pg.broadcast(meta, 0).wait()
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                pg.broadcast(buffer, 0).wait()
                tensors = unflatten(pickle.loads(meta.cpu().numpy().tobytes()), buffer)
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
    ) -> None:
        if receivers < 1:
            raise ValueError(f"a broadcast group needs at least one receiver, got {receivers}")
        if rank is not None and not 0 <= rank <= receivers:
            raise ValueError(f"rank {rank} outside a group of 1 publisher and {receivers} receivers")
        _resolve(backend)
        self.group = _Group(address, receivers + 1, backend, timeout_s)
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

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``named_tensors`` into one buffer and queue its broadcast as ``version``."""
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
            endpoint.outbox.put((_STOP, [], torch.empty(0, dtype=torch.uint8)))
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
