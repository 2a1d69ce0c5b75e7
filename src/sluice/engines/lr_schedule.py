"""The learning-rate schedule of a train engine: warmup, then constant, linear or cosine decay.

A frozen, picklable description (Ray workers receive it) that builds ``transformers``'
scheduler for an optimizer; counted in optimizer updates. The warmup reaches the full rate at its
last update and starts above 0 (update k of W runs at k / W, verl's and most trainers' habit:
an update at rate 0 is a wasted step); the decay follows ``transformers``' shapes. It does not
step anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import get_scheduler

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""sluice's names → ``transformers.get_scheduler``'s (each warms up linearly first)."""


@dataclass(frozen=True)
class LrSchedule:
    name: str
    """``constant``, ``linear`` (to 0) or ``cosine`` (to 0), after the warmup."""
    warmup_updates: int
    total_updates: int

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"unknown LR schedule {self.name!r}; known: {', '.join(SCHEDULES)}")
        if not 0 <= self.warmup_updates <= self.total_updates:
            raise ValueError(f"warmup ({self.warmup_updates}) must be within 0..{self.total_updates} updates")

    def build(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        shape = get_scheduler(
            SCHEDULES[self.name], optimizer, num_warmup_steps=self.warmup_updates, num_training_steps=self.total_updates
        )
        decay = shape.lr_lambdas[0]  # type: ignore[attr-defined]
        warmup = self.warmup_updates

        def factor(update: int) -> float:
            return (update + 1) / warmup if update < warmup else float(decay(update))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
