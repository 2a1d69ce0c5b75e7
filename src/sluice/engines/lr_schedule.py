"""The learning-rate schedule of a train engine: warmup, then constant, linear or cosine decay.

A frozen, picklable description (Ray workers receive it) that builds the
scheduler (torch's ``LambdaLR``) of an optimizer; counted in optimizer updates. The warmup
reaches the full rate at its last update and starts above 0 (update k of W runs at k / W, verl's
habit: an update at rate 0 is a wasted step); the decays are ``transformers``' linear and cosine
shapes. It does not step anything itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("constant", "linear", "cosine")
"""The shapes after the warmup (each warms up linearly first)."""


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

    def build(self, optimizer: torch.optim.Optimizer, done: int = 0) -> torch.optim.lr_scheduler.LRScheduler:
        """The scheduler of ``optimizer`` with ``done`` updates behind it (a resumed run's: its
        param groups carry ``initial_lr``), its rate set for the next."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor, last_epoch=done - 1)

    def factor(self, update: int) -> float:
        """The rate of 0-based ``update`` as a fraction of ``trainer.lr``: ``(k + 1) / W`` while
        warming up, then 1, or a linear or half-cosine decay to 0 at ``total_updates``."""
        warmup, total = self.warmup_updates, self.total_updates
        if update < warmup:
            return (update + 1) / warmup
        progress = (update - warmup) / max(1, total - warmup)
        if self.name == "linear":
            return max(0.0, 1.0 - progress)
        if self.name == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return 1.0
