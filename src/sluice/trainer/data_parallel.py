"""Data-parallel training ranks: one process group over the trainer workers of a run.

Each rank trains its own share of a step's groups; the train engine sums the gradients over the
ranks before each optimizer update (one per step by default; one per PPO mini-batch and epoch
otherwise) as its strategy does it (``engines/strategies.py``: DDP all-reduce or FSDP2
reduce-scatter). The ranks agree on each update's normaliser (and whole-batch advantages) by
gathering the step's samples once (``all_gather``), and add their step metrics (``sum_metrics``).

``gloo`` for CPU tensors, ``nccl`` for CUDA ones. Deliberately not here: choosing which rank
trains which group (the pipeline balances groups by tokens), tensor or pipeline parallelism.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sluice.engines.strategies import collective_backend

NOT_SUMMED = frozenset(
    {"grad_norm", "skipped_steps", "optimizer_steps", "lr", "value_grad_norm", "value_mean", "return_mean"}
)
"""Step metrics every rank computes identically after the gradient sum (not added across ranks)."""
PER_RANK = {"logprob_gap_mean": "mean", "logprob_gap_max": "max"}
"""Step metrics of each rank's own first micro-batch: averaged or maxed over the ranks."""


class DataParallelGroup:
    """This process's membership of the trainer ranks' process group (blocks until all join)."""

    def __init__(
        self, address: str, rank: int, world_size: int, device: torch.device, timeout_s: float = 120.0
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        dist.init_process_group(
            collective_backend(device),
            init_method=address,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.rank = rank
        self.world_size = world_size

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled: for metadata, never tensors of weights)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Step metrics added over the ranks (losses, counts), except ``NOT_SUMMED`` ones and the
        ``PER_RANK`` ones (each rank's, averaged or maxed over the ranks that report them)."""
        everyone = self.all_gather(metrics)
        total = dict(metrics)
        for key in {k for m in everyone for k in m if k not in NOT_SUMMED}:
            values = [m[key] for m in everyone if key in m]
            how = PER_RANK.get(key)
            total[key] = max(values) if how == "max" else sum(values) / len(values) if how else sum(values)
        return total

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
