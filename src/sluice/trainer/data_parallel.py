"""Data-parallel training ranks: one process group over the trainer workers of a run.

Every rank holds the full model (DDP-style replicas; FSDP2 sharding is for GPUs, where one
replica does not fit) and trains its own shard of a step's groups. Before each optimizer update
(one per step by default; one per PPO mini-batch and epoch otherwise) the ranks sum their
gradients with one all-reduce of a flat buffer (``AllReducedEngine``); they agree on each
update's normaliser (and whole-batch advantages) by gathering the step's samples once, and each
takes the same optimizer step, so the replicas stay identical without ever broadcasting
weights. Weights for the engines are never gathered: every rank already holds them whole, and
only rank 0 exports and publishes them, so a sync costs one copy whatever the number of ranks.

``gloo`` on CPU, ``nccl`` on CUDA. Deliberately not here: choosing which rank trains which group
(the pipeline balances groups by tokens), tensor or pipeline parallelism.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sluice.api import Algorithm, MicroBatch, Sample
from sluice.engines.hf_train import HFTrainEngine

NOT_SUMMED = frozenset({"grad_norm", "skipped_steps", "optimizer_steps"})
"""Step metrics every rank computes identically after the all-reduce (not added across ranks)."""


def free_tcp_address() -> str:
    """A ``tcp://host:port`` rendezvous on this node, on a port free right now."""
    host = socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


class DataParallelGroup:
    """This process's membership of the trainer ranks' process group (blocks until all join)."""

    def __init__(self, address: str, rank: int, world_size: int, timeout_s: float = 120.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method=address, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        self.rank = rank
        self.world_size = world_size

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks, in one flat buffer (a rank that saw no
        data contributes zeros)."""
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled: for metadata, never tensors of weights)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Step metrics added over the ranks (losses, counts), except ``NOT_SUMMED`` ones."""
        total = dict(metrics)
        for i, other in enumerate(self.all_gather(metrics)):
            if i == self.rank:
                continue
            for key, value in other.items():
                if key not in NOT_SUMMED:
                    total[key] = total.get(key, 0.0) + value
        return total

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class AllReducedEngine:
    """A train engine whose every optimizer update first sums the gradients over the ranks.

    Each rank accumulates its own samples of an update (maybe none: it then contributes zeros),
    and ``finish_step`` all-reduces before the engine scales by the update's step-wide
    normaliser, clips and steps, so clipping sees the whole update's gradient.
    """

    def __init__(self, engine: HFTrainEngine, group: DataParallelGroup) -> None:
        self.engine = engine
        self.group = group

    def logprobs(self, samples: Sequence[Sample], temperature: float) -> list[list[float]]:
        return self.engine.logprobs(samples, temperature)

    def begin_step(self) -> None:
        self.engine.begin_step()

    def accumulate(self, mb: MicroBatch, algorithm: Algorithm) -> None:
        self.engine.accumulate(mb, algorithm)

    def finish_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        self.group.all_reduce_grads(self.engine.model.parameters())
        return self.engine.finish_step(grad_scale)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.export_weights()

    def save(self, path: str, *, optimizer: bool = True) -> None:
        self.engine.save(path, optimizer=optimizer)

    def load(self, path: str) -> None:
        self.engine.load(path)
