"""The weight broadcast group's wire format: how one version travels from trainer rank 0 to every
receiver rank, bucket by bucket.

A version is one flat ``uint8`` buffer (``flatten``: every tensor's bytes, tied aliases once) cut
into byte ranges of about ``trainer.weight_bucket_mb`` (``bucket_ranges``: cuts only between
tensors). On the wire: a header ``[version, layout bytes, total bytes]``, the pickled
``(layout, ranges)``, then each range as its own broadcast. A receiver that keeps the whole
version receives the ranges into one buffer (``weights/broadcast.py``); one that loads as it goes
receives each range into a fresh buffer and hands its tensors on (``bucket_tensors``), so it never
holds more than the buckets its consumer still references (vLLM's workers:
``engines/vllm_weight_group.py``). ``connect`` makes the group's process group on its own
``TCPStore``, never the default group.

Not here: threads, version bookkeeping, what a receiver does with the tensors.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

STOP = -2
"""Header version that tells receivers the publisher closed."""
Layout = list[tuple[str, str, tuple[int, ...], int, int]]
"""Each tensor as (name, dtype, shape, byte offset, bytes); aliases repeat an offset."""
Ranges = list[tuple[int, int]]
"""A version's buckets as byte ranges ``[start, end)`` of its buffer."""


def resolve(backend: str) -> tuple[str, torch.device]:
    """The collective library and the device its buffers live on (``auto``: NCCL when CUDA is up)."""
    name = backend if backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if name not in ("gloo", "nccl"):
        raise ValueError(f"weight broadcast backend must be auto, gloo or nccl, got {backend!r}")
    return name, torch.device("cuda", torch.cuda.current_device()) if name == "nccl" else torch.device("cpu")


def connect(address: str, world_size: int, rank: int, backend: str, timeout_s: float) -> Any:
    """This process's member of the group meeting at ``address`` (``tcp://host:port``; rank 0
    hosts the store); blocks until every rank has joined."""
    url = urlparse(address)
    assert url.hostname is not None and url.port is not None, f"bad address {address!r}"
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(url.hostname, url.port, world_size, rank == 0, timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore("sluice-weights", store)
    if resolve(backend)[0] == "nccl":
        from torch.distributed import ProcessGroupNCCL  # only in CUDA builds

        return ProcessGroupNCCL(prefixed, rank, world_size, ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


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


def unflatten(layout: Layout, buffer: torch.Tensor, start: int = 0) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer`` as ``flatten`` laid it out (no copy); ``buffer`` may be a bucket
    that begins at byte ``start`` of the version, when ``layout`` holds only its tensors."""
    out = {}
    for name, dtype, shape, offset, nbytes in layout:
        raw = buffer[offset - start : offset - start + nbytes]
        kind = getattr(torch, dtype)
        out[name] = raw.view(kind).reshape(shape) if nbytes else torch.empty(shape, dtype=kind)
    return out


def bucket_ranges(layout: Layout, bucket_bytes: int) -> Ranges:
    """``flatten``'s buffer as byte ranges of at least ``bucket_bytes`` (the last may be smaller),
    cut only between tensors; one empty range for an empty version."""
    ranges: Ranges = []
    start = end = 0
    for offset, nbytes in sorted({(offset, nbytes) for *_, offset, nbytes in layout}):
        end = max(end, offset + nbytes)
        if end - start >= bucket_bytes:
            ranges.append((start, end))
            start = end
    if end > start or not ranges:
        ranges.append((start, end))
    return ranges


def bucket_layout(layout: Layout, ranges: Ranges, index: int) -> Layout:
    """The entries of ``layout`` whose bytes lie in bucket ``index`` (aliases with their source;
    empty tensors in the last bucket)."""
    start, end = ranges[index]
    last = index == len(ranges) - 1
    return [e for e in layout if start <= e[3] < end or (e[4] == 0 and last and e[3] >= start)]


def send_version(
    pg: Any, device: torch.device, version: int, layout: Layout, buffer: torch.Tensor, ranges: Ranges
) -> None:
    """Broadcast one version from rank 0: header, ``(layout, ranges)``, then each bucket."""
    meta = torch.frombuffer(bytearray(pickle.dumps((layout, ranges))), dtype=torch.uint8)
    header = torch.tensor([version, meta.numel(), buffer.numel()], dtype=torch.int64)
    pg.broadcast(header.to(device), 0).wait()
    pg.broadcast(meta.to(device), 0).wait()
    for start, end in ranges:
        if end > start:
            pg.broadcast(buffer[start:end], 0).wait()


def send_stop(pg: Any, device: torch.device) -> None:
    """Tell every receiver the publisher closed."""
    pg.broadcast(torch.tensor([STOP, 0, 0], dtype=torch.int64).to(device), 0).wait()


def receive_header(pg: Any, device: torch.device) -> tuple[int, Layout, Ranges]:
    """The next version's number, layout and bucket ranges (its buckets follow: ``receive_bucket``
    each, in order); ``ConnectionError`` when the publisher closed."""
    header = torch.zeros(3, dtype=torch.int64, device=device)
    pg.broadcast(header, 0).wait()
    version, meta_bytes, _ = header.tolist()
    if version == STOP:
        raise ConnectionError("the weight publisher closed the broadcast group")
    meta = torch.empty(meta_bytes, dtype=torch.uint8, device=device)
    pg.broadcast(meta, 0).wait()
    layout, ranges = pickle.loads(meta.cpu().numpy().tobytes())
    return version, layout, ranges


def receive_bucket(
    pg: Any, device: torch.device, start: int, end: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Bucket ``[start, end)`` of the version being received, into ``out`` or a fresh buffer."""
    buffer = out if out is not None else torch.empty(end - start, dtype=torch.uint8, device=device)
    if end > start:
        pg.broadcast(buffer, 0).wait()
    return buffer
