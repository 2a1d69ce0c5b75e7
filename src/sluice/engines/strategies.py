"""How a train engine's model is laid out over the trainer ranks: ``single``, ``ddp``, ``fsdp2``.

``ddp`` wraps the model in torch ``DistributedDataParallel`` (a full replica per rank; the
engine accumulates micro-batches through the bare model and one idle pass through the wrapper
per optimizer update all-reduces the summed gradients). ``fsdp2`` applies torch ``fully_shard`` to every
decoder layer and then to the root, with a ``MixedPrecisionPolicy`` (compute in the engine's
dtype, gradients reduced in float32) and optionally ``CPUOffloadPolicy``: parameters, gradients
and optimizer state live sharded, and every forward gathers one layer at a time, which makes each
forward a collective that all ranks must run together (``lockstep_count``).

``GatheredWeights`` hands a sharded model's full weights to a ``WeightSync`` as a mapping whose
iteration gathers them bucket by bucket in state-dict (layer) order, dropping each bucket before
the next is gathered (with LoRA, each adapted weight merged as it is gathered: the plain model's
names, as every engine loads them). Checkpoints of a sharded model go through ``torch.distributed.checkpoint``
(``save_sharded`` / ``load_sharded``: each rank writes its own shard).

Deliberately not here: which samples a rank trains, the loss, tensor or pipeline parallelism.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import ItemsView, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from sluice.engines.lora import LoraMerge

SCHEDULER_FILE = "lr_scheduler.pt"
"""The LR scheduler's state inside a checkpoint folder (every strategy)."""
SHARDED_DIR = "dcp"
"""The ``torch.distributed.checkpoint`` folder inside a sharded engine's checkpoint."""


def collective_backend(device: torch.device) -> str:
    """The process-group backend for tensors on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class Hugging Face lists as not to be split
    (``_no_split_modules``, e.g. ``Qwen2DecoderLayer``), found through any wrapper (LoRA)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    inner = getattr(model, "base_model", None)
    names |= set(getattr(getattr(inner, "model", inner), "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard")
    return layers


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``DistributedDataParallel`` over the default group, buffers not re-broadcast per forward."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:  # torch >= 2.13
        return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def shard_fsdp2(model: torch.nn.Module, compute_dtype: torch.dtype, cpu_offload: bool) -> None:
    """``fully_shard`` each decoder layer, then the root, in place (parameters become DTensors)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    low = compute_dtype in (torch.bfloat16, torch.float16)  # else compute in the parameters' dtype
    mixed = MixedPrecisionPolicy(
        param_dtype=compute_dtype if low else None, reduce_dtype=torch.float32 if low else None
    )
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mixed, offload_policy=offload)
    fully_shard(model, mp_policy=mixed, offload_policy=offload)


def lockstep_count(mine: int, device: torch.device) -> int:
    """The largest of every rank's ``mine`` (forward passes it has to run): each rank runs that
    many, padding with idle ones, so the sharded forwards' collectives pair up."""
    count = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or gradient norm; gathers a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class GatheredWeights(Mapping[str, torch.Tensor]):
    """A sharded model's weights as full tensors, gathered on demand (see the module docstring).

    Every rank must iterate it the same way (each gather is a collective): the publishing rank
    hands it to the weight sync, the others ``drain`` it.
    """

    def __init__(self, model: torch.nn.Module, bucket_bytes: int, merge: LoraMerge | None = None) -> None:
        self._state = model.state_dict()  # the local shards; nothing is gathered yet
        self.bucket_bytes = bucket_bytes
        self._merge = merge
        self._names = list(merge.sources) if merge is not None else list(self._state)

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._merge is not None:  # LoRA: the plain model's tensor, adapters merged in
            return self._merge.tensor(name, self._gathered)
        return self._gathered(name)

    def _gathered(self, key: str) -> torch.Tensor:
        return full_tensor(self._state[key]).detach()

    def items(self) -> ItemsView[str, torch.Tensor]:
        return _BucketItems(self)

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Full tensors in state-dict order, about ``bucket_bytes`` at a time."""
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for name in self._names:
            tensor = self[name]
            bucket[name] = tensor
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = {}, 0  # the consumer's copy is the only one left
        if bucket:
            yield bucket

    def drain(self) -> None:
        """Take part in every gather without keeping anything (the ranks that do not publish)."""
        for _ in self.buckets():
            pass


class _BucketItems(ItemsView[str, torch.Tensor]):
    """``items()`` of ``GatheredWeights``: one pass, one bucket alive at a time."""

    def __init__(self, weights: GatheredWeights) -> None:
        super().__init__(weights)
        self.weights = weights

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.weights.buckets():
            while bucket:
                name = next(iter(bucket))
                yield name, bucket.pop(name)  # popped: the bucket does not outlive its tensors


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    path: str | Path,
    rank: int,
) -> None:
    """A sharded engine's checkpoint, called on every rank: each rank writes its shard of the
    model and optimizer state under ``path/SHARDED_DIR``, rank 0 the config and the LR
    scheduler's state. (A final model is gathered instead: ``full_state_dict``.)"""
    os.makedirs(path, exist_ok=True)
    save_shards(model, optimizer, Path(path) / SHARDED_DIR)
    if rank > 0:
        return
    model.config.save_pretrained(path)  # type: ignore[union-attr, operator]
    if scheduler is not None:
        torch.save(scheduler.state_dict(), Path(path) / SCHEDULER_FILE)


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """This rank's shard of ``model``'s and ``optimizer``'s state into the DCP ``folder``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Read ``save_sharded``'s shards back into this rank's model and optimizer (call only on a
    checkpoint whose manifest was verified: DCP's metadata file is a pickle)."""
    load_shards(model, optimizer, Path(path) / SHARDED_DIR)


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """``save_shards``' DCP ``folder`` back into this rank's ``model`` and ``optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU, gathered on every rank's call (rank 0 writes it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
