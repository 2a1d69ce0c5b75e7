"""The synchronous RL loop (``run.mode: sync``): the classic generate → score → train → sync.

It reads as the algorithm and nothing else: every call is a step of the loop, the work lives
in the pipeline it drives (``sluice.RLTrainer``). The asynchronous loop must reproduce this one
exactly at η = 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from sluice.api import PromptItem, Sample


class SyncPipeline(Protocol):
    """What the synchronous loop needs from the components it drives."""

    version: int

    def admit(self, num_groups: int) -> list[tuple[PromptItem, int]]: ...

    def generate(self, groups: Sequence[tuple[PromptItem, int]]) -> list[Sample]: ...

    def send_experience_data(self, samples: Sequence[Sample]) -> None: ...

    def recv_experience_data(self, num_groups: int) -> list[Sample]: ...

    def train(self, samples: Sequence[Sample]) -> dict[str, float]: ...

    def sync_actor_model(self) -> None: ...


def run_sync(
    pipeline: SyncPipeline,
    steps: int,
    prompts_per_step: int,
    after_step: Callable[[int, list[Sample], dict[str, float]], bool],
) -> None:
    """Run until ``pipeline.version == steps`` or ``after_step`` returns False."""
    while pipeline.version < steps:
        groups = pipeline.admit(prompts_per_step)  # admit B prompt groups
        samples = pipeline.generate(groups)  # generate n responses each, score them
        pipeline.send_experience_data(samples)  # store
        batch = pipeline.recv_experience_data(len(groups))  # take the global batch
        metrics = pipeline.train(batch)  # one training step: version v -> v + 1
        pipeline.sync_actor_model()  # engines now hold version v + 1
        if not after_step(pipeline.version, batch, metrics):
            break
