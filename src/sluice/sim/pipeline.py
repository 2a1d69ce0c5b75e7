"""``SimPipeline``: the asynchronous controller's pipeline with simulated engines and trainer.

Everything on the rollout side is the product code — ``LLMProxy`` over ``SimEngine`` replicas,
``GroupRunner`` (queue or batch scheduling, dynamic filter, abort of surplus groups), the
single-turn workflow and a local TransferQueue — so a benchmark or the planner driving it with
the real ``Controller`` measures sluice's own scheduling. The trainer only spends simulated
time (per streamed sample, plus an optimizer step) and drops the rows it "trained"; weights are
version numbers. Run it on ``sim.clock.run_virtual`` for exact, instant results.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sluice.api import GroupReport, LengthPredictor, PromptItem, RewardFn, SamplingParams
from sluice.api.protocols import WeightUpdateMode
from sluice.queue import AsyncLocalQueue, LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS, group_rows
from sluice.rollout.filters import GroupFilter
from sluice.rollout.groups import GroupRunner, Scheduling
from sluice.rollout.proxy import LLMProxy
from sluice.rollout.single_turn import SingleTurnWorkflow
from sluice.rollout.skew_dispatch import LongTailSplit
from sluice.sim.engine import SimEngine
from sluice.sim.task import SimReward, SimTokenizer

TRAIN_TASK = "train"


@dataclass(frozen=True)
class SimTrainerConfig:
    """Simulated training cost (seconds of simulated time)."""

    per_sample_s: float = 0.0
    """Forward + backward of one streamed sample."""
    step_s: float = 0.0
    """The optimizer step and weight publish that end a training step."""


class SimPipeline:
    """An ``Pipeline`` over simulated replicas (see the module docstring)."""

    def __init__(
        self,
        engines: Sequence[SimEngine],
        prompts: Sequence[PromptItem],
        *,
        group_size: int,
        max_new_tokens: int,
        weight_update: WeightUpdateMode = "interrupt",
        trainer: SimTrainerConfig | None = None,
        reward: RewardFn | None = None,
        group_filter: GroupFilter | None = None,
        scheduling: Scheduling = "queue",
        prompt_replication: bool = True,
        stagger: int = 1,
        seed: int = 0,
        time_scale: float = 1.0,
        length_predictor: LengthPredictor | None = None,
        long_tail: LongTailSplit | None = None,
    ) -> None:
        self.engines = list(engines)
        slots = max(e.config.max_running for e in self.engines) if length_predictor is not None else None
        self.proxy = LLMProxy(
            self.engines,
            prompt_replication=prompt_replication,
            stagger=stagger,
            length_predictor=length_predictor,  # longest-predicted-first over the replicas' slots
            slots=slots,
            long_tail=long_tail,  # skewness-aware dispatch: dedicated long-tail replicas
        )
        self.queue = LocalQueue()
        self.queue.register_task(TRAIN_TASK, SAMPLE_COLUMNS)
        workflow = SingleTurnWorkflow(SimTokenizer(), SamplingParams(max_new_tokens), group_size, seed)
        self.runner = GroupRunner(
            self.proxy,
            workflow,
            AsyncLocalQueue(self.queue),
            reward or SimReward(time_scale=time_scale),
            group_filter=group_filter,
            scheduling=scheduling,
        )
        self.group_size = group_size
        self.weight_update = weight_update
        self.trainer = trainer or SimTrainerConfig()
        self.time_scale = time_scale
        self.engine_version = 0
        self._prompts = itertools.cycle(prompts)

    def next_prompt(self) -> PromptItem:
        return next(self._prompts)

    def rollout_wave(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        return self.runner.run_groups(groups)

    async def abort_groups(self, group_ids: list[int], reason: str) -> None:
        self.runner.abort_groups(group_ids, reason)

    async def begin_step(self) -> None:
        pass

    async def train_groups(self, group_ids: list[int]) -> None:
        await self._sleep(self.trainer.per_sample_s * self.group_size * len(group_ids))
        self.queue.clear([row for gid in group_ids for row in group_rows(gid, self.group_size)])

    async def finish_step(self) -> dict[str, float]:
        await self._sleep(self.trainer.step_s)
        return {}

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Push ``version`` through the proxy; return once every replica holds it. ``weight_load_s``
        is how long handing it over took (what generation waited for)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self.proxy.sync_weights({}, version, self.weight_update)
        handed = loop.time()
        while self.proxy.stats()["version"] < version:
            await asyncio.sleep(self.proxy.poll_s)
        self.engine_version = version
        return {"weight_load_s": (handed - start) / self.time_scale}

    async def _sleep(self, sim_seconds: float) -> None:
        if sim_seconds > 0:
            await asyncio.sleep(sim_seconds * self.time_scale)


def stalled_together_s(engines: Sequence[SimEngine]) -> float:
    """Simulated seconds during which every engine was inside a weight-update window at once:
    the weight sync time exposed to the whole rollout."""
    if not engines:
        return 0.0
    events = sorted(
        (t, delta) for e in engines for start, end in e.update_windows for t, delta in ((start, 1), (end, -1))
    )
    inside, since, total = 0, 0.0, 0.0
    for t, delta in events:
        if inside == len(engines):
            total += t - since
        inside += delta
        since = t
    return total
