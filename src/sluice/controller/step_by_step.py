"""The run's workers driven one verb at a time from plain synchronous code (AsyncFlow's user level).

``StepByStep`` places the same pipeline ``fit`` uses (``run.backend``: local or Ray) and runs
its coroutines on an event loop of its own, in a thread, so a user's loop can call ``generate``
(a wave of prompt groups: generated, scored, filtered and written to the TransferQueue),
``train`` (the trainer reads those groups from the queue itself and takes one optimizer step)
and ``sync_weights`` (the engines load the newest version) in whatever order it likes. With a
step's groups sent as one wave and trained in id order, this is exactly the ``sync`` schedule.
Every reported group goes to the run's ``FailureBudget``, as in ``fit``: a reward or environment
over ``run.failure_budget`` makes ``generate`` raise ``FailureBudgetExceeded`` (one line).

Deliberately not here: admission control, staleness, checkpoints (``fit``'s controller owns
them), choosing prompts or group ids (the caller does).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from sluice.api import GroupReport, PromptItem
from sluice.config import ConfigError, SluiceConfig
from sluice.config.data import EvalConfig
from sluice.controller.training import place_single
from sluice.data import PromptStream
from sluice.rollout.evaluate import EvalResult
from sluice.runtime.pipelines import LocalPipeline, PipelineSpec
from sluice.runtime.ray_pipeline import RayPipeline
from sluice.schedule.failures import FailureBudget

T = TypeVar("T")


class StepByStep:
    """One run's workers, each verb a blocking call; ``close`` ends them."""

    def __init__(self, config: SluiceConfig, spec: PipelineSpec, prompts: PromptStream) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sluice-step-by-step", daemon=True)
        self._thread.start()
        self.version = 0
        """The version of the trainer's weights (optimizer steps taken)."""
        self.failures = FailureBudget(config.run.failure_budget, config.run.failure_window)

        if config.run.controller == "multi":
            raise ConfigError("run.controller=multi: its workers admit their own groups; use single here")

        async def place() -> LocalPipeline | RayPipeline:
            return place_single(config, spec, prompts)

        self.pipeline = self._call(place())

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def generate(self, groups: Sequence[tuple[PromptItem, int]]) -> list[GroupReport]:
        """Generate, score and store ``groups`` (prompt, group id) as one wave; every group's report.
        Raises ``FailureBudgetExceeded`` when the wave puts a reward or environment over budget."""

        async def wave() -> list[GroupReport]:
            return [report async for report in self.pipeline.rollout_wave(list(groups))]

        reports = self._call(wave())
        for report in reports:
            self.failures.record(report)
        return reports

    def train(self, group_ids: Sequence[int]) -> dict[str, float]:
        """One optimizer step over these stored groups, in this order (version v → v + 1)."""

        async def step() -> dict[str, float]:
            await self.pipeline.begin_step()
            await self.pipeline.train_groups(list(group_ids))
            return await self.pipeline.finish_step()

        metrics = self._call(step())
        self.version += 1
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """The engines load the trainer's newest version (returns the sync's timings)."""
        return self._call(self.pipeline.sync_weights(self.version))

    def evaluate(self, items: Sequence[PromptItem], max_new_tokens: int, config: EvalConfig) -> EvalResult:
        return self._call(self.pipeline.evaluate(items, max_new_tokens, config))

    def save(self, path: str) -> None:
        """The trained policy as an HF folder."""
        self._call(self.pipeline.save(path))

    def close(self) -> None:
        try:
            self.pipeline.close()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
