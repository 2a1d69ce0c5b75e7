"""PPO's critic values as a TransferQueue task: the ``critic`` task writes the ``values`` column.

``CriticValuesWorker`` holds a copy of the critic and serves the ``critic`` task with
``ColumnTaskWorker``'s loop: rows are valued as soon as rollout writes them, beside generation
and training (a thread with ``backend: local``, a Ray actor on ``ray``), and the ``train`` task
lists ``values`` among its inputs. The critic is trained in the trainer's step
(``trainer/ppo.py``: ``ppo_critic_step``), which publishes the critic's weights through a
``WeightSync`` before the policy of the same version; this worker loads the newest version
before each batch and never values a row with a critic older than the policy that generated it
(the row's version). At η = 0 that is exactly the critic the synchronous loop values the step
with, so both give the same losses; with η ≥ 1 a row's values come from the newest critic at the
time it was written, as its behaviour log-probs come from the policy that sampled it, and the
trainer's value clipping is taken around them.

Deliberately not here: GAE and the critic's updates (``trainer/ppo.py``), the value model
(``engines/critic.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from sluice.api import Batch, QueueClient, Sample, WeightSync
from sluice.trainer.column_task import ColumnTaskWorker
from sluice.trainer.ppo import VALUES_COLUMN, CriticSpec

CRITIC_TASK = "critic"
WEIGHT_POLL_S = 0.005


class CriticValuesWorker(ColumnTaskWorker):
    """Serves the ``critic`` task of ``queue`` with the critic ``critic_sync`` publishes."""

    task = CRITIC_TASK
    output = VALUES_COLUMN

    def __init__(
        self,
        model_dir: str | Path,
        queue: QueueClient,
        spec: CriticSpec,
        critic_sync: WeightSync,
        *,
        batch_rows: int = 64,
        threads: int = 1,
        wait_s: float = 600.0,
    ) -> None:
        torch.set_num_threads(threads)
        super().__init__(queue, batch_rows)
        self.critic = spec.engine(model_dir)  # version 0: every build of the critic is the same
        self.critic.model.requires_grad_(False)
        self.critic_sync = critic_sync
        self.version = 0
        self.wait_s = wait_s

    def compute(self, batch: Batch, samples: Sequence[Sample]) -> list[list[float]]:
        self.load_newest(max(m.version for m in batch.meta))
        return self.critic.values(samples)

    def load_newest(self, at_least: int) -> None:
        """Load the newest published critic, waiting until it is at least version ``at_least``."""
        deadline = time.monotonic() + self.wait_s
        while max(self.version, self.critic_sync.latest_version()) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"critic version {at_least} was not published within {self.wait_s} s")
            time.sleep(WEIGHT_POLL_S)
        newest = self.critic_sync.latest_version()
        if newest > self.version:
            self.critic.load_weights(self.critic_sync.fetch(newest))
            self.version = newest
