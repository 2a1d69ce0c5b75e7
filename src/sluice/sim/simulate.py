"""Discrete-event simulation of the whole pipeline: ``simulate(SimConfig) -> SimResult``.

The events are the real code's: sluice's ``Controller`` and ``GroupLedger``, the ``LLMProxy``,
``GroupRunner`` and TransferQueue run over ``SimEngine`` replicas on ``run_virtual``'s clock,
which jumps from one event to the next. Only the trainer is a cost: micro-batches of up to
``micro_batch_tokens`` tokens, each ``overhead + tokens · token_s``, then an optimizer step,
faster while no replica is busy when it shares their device (``sim.contention``). Modes
``sync``, ``streaming``, ``one_step`` and ``async``, and what the result carries (step times,
utilisation, bubbles, the timeline as the real run's Chrome-trace events, so ``sluice trace``
draws it): docs/planner.md, "Simulator".

It does not choose a configuration (``sim.planner`` does) or derive costs from hardware
(``sim.cost_model`` does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sluice.api import GroupReport, PromptItem
from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.sim.clock import run_virtual
from sluice.sim.contention import SharedDevice
from sluice.sim.cost_model import TrainerCost
from sluice.sim.engine import SimEngine, SimEngineConfig
from sluice.sim.pipeline import SimPipeline, stalled_together_s
from sluice.sim.task import SimReward, sim_prompts
from sluice.telemetry.trace import SpanRecorder

Mode = Literal["sync", "streaming", "one_step", "async"]
MODES: tuple[Mode, ...] = ("sync", "streaming", "one_step", "async")


@dataclass(frozen=True)
class SimConfig:
    """One pipeline configuration (times in simulated seconds)."""

    engine: SimEngineConfig
    trainer: TrainerCost
    replicas: int = 1
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 4096
    prompt_len: int = 64
    mode: Mode = "async"
    eta: int = 1
    """Staleness bound in ``async`` mode (the other modes fix it)."""
    weight_update: Literal["interrupt", "defer", "staggered"] = "interrupt"
    stagger: int = 1
    reward_latency_s: float = 0.0
    reward_workers: int | None = None
    steps: int = 8
    warmup_steps: int = 1
    """Leading steps left out of the mean step time (the pipeline filling up)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.replicas < 1 or self.steps <= self.warmup_steps or self.eta < 0:
            raise ValueError(f"need replicas >= 1, steps > warmup_steps and eta >= 0: {self}")

    @property
    def staleness(self) -> int:
        return {"sync": 0, "streaming": 0, "one_step": 1}.get(self.mode, self.eta)


@dataclass(frozen=True)
class SimResult:
    step_s: float
    """Mean simulated seconds per training step after the warm-up steps."""
    step_times: tuple[float, ...]
    generation_utilisation: float
    """Share of replica-seconds (of every replica from its start) spent decoding, prefilling or
    loading weights."""
    trainer_utilisation: float
    exposed_sync_s: float
    """Per step: seconds every replica at once took no requests for a weight update."""
    samples_per_s: float
    staleness: dict[int, int]
    counters: dict[str, float]
    events: list[dict[str, Any]] = field(repr=False)

    @property
    def generation_bubble(self) -> float:
        return 1.0 - self.generation_utilisation

    @property
    def trainer_bubble(self) -> float:
        return 1.0 - self.trainer_utilisation

    def summary(self) -> dict[str, float]:
        return {
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "generation_utilisation": self.generation_utilisation,
            "trainer_utilisation": self.trainer_utilisation,
            "generation_bubble": self.generation_bubble,
            "trainer_bubble": self.trainer_bubble,
            "exposed_sync_s": self.exposed_sync_s,
            "max_staleness": float(max(self.staleness, default=0)),
        }


class TracedSimEngine(SimEngine):
    """A ``SimEngine`` that records its decode runs and weight stalls as spans (simulated ns)
    and reports them to the device it shares with the trainer."""

    def __init__(self, config: SimEngineConfig, recorder: SpanRecorder, lane: str, device: SharedDevice) -> None:
        super().__init__(config)
        self._recorder = recorder
        self._lane = lane
        self._device = device
        self.created_at = self._now()

    async def _decode(self, wake: asyncio.Event) -> None:
        start = self._now()
        with self._device.busy():
            await super()._decode(wake)
        self._span("decode", start)

    async def _stall(self, sim_seconds: float) -> None:
        start = self._now()
        with self._device.busy():
            await super()._stall(sim_seconds)
        self._span("weight_load", start)

    async def _admit(self) -> None:
        start = self._now()
        with self._device.busy():
            await super()._admit()
        self._span("prefill", start)

    def _span(self, name: str, start: float) -> None:
        end = self._now()
        if end > start:
            self._recorder.add(name, _ns(start), _ns(end), lane=self._lane)


class CostedTrainerPipeline(SimPipeline):
    """``SimPipeline`` whose trainer packs streamed groups into token-budgeted micro-batches;
    without ``streaming`` it trains the whole step's batch only once the step's groups are in."""

    def __init__(
        self,
        engines: Sequence[TracedSimEngine],
        *args: Any,
        cost: TrainerCost,
        streaming: bool,
        prompt_len: int,
        device: SharedDevice,
        **kwargs: Any,
    ) -> None:
        super().__init__(engines, *args, **kwargs)
        self.traced = list(engines)
        self.cost = cost
        self.device = device
        self.streaming = streaming
        self.prompt_len = prompt_len
        self.recorder = SpanRecorder("trainer")
        self.rollout_recorder = SpanRecorder("rollout")
        self.train_busy_s = 0.0
        self._tokens: dict[int, int] = {}
        self._pending = 0

    async def _reports(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        async for report in super().rollout_wave(groups):
            self._tokens[report.group_id] = report.response_tokens + report.num_samples * self.prompt_len
            yield report

    def rollout_wave(self, groups: Sequence[tuple[PromptItem, int]]) -> AsyncIterator[GroupReport]:
        return self._reports(groups)

    async def train_groups(self, group_ids: list[int]) -> None:
        self._pending += sum(self._tokens.pop(gid) for gid in group_ids)
        await super().train_groups(group_ids)  # frees the rows (its per-sample cost is 0)
        while self.streaming and self._pending >= self.cost.micro_batch_tokens:
            await self._microbatch(self.cost.micro_batch_tokens)

    async def finish_step(self) -> dict[str, float]:
        while self._pending > 0:
            await self._microbatch(min(self._pending, self.cost.micro_batch_tokens))
        await self._timed("optimizer_step", self.cost.step_s)
        return {}

    async def _microbatch(self, tokens: int) -> None:
        self._pending -= tokens
        await self._timed("train_microbatch", self.cost.microbatch_overhead_s + tokens * self.cost.token_s, tokens)

    async def _timed(self, name: str, seconds: float, tokens: int = 0) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self.device.spend(seconds, self.cost.alone_speedup)
        self.train_busy_s += loop.time() - start
        if tokens:
            self.recorder.add(name, _ns(start), _ns(loop.time()), tokens=tokens)
        else:
            self.recorder.add(name, _ns(start), _ns(loop.time()))


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


StepHook = Callable[[int, CostedTrainerPipeline], Awaitable[None]]


def simulate(config: SimConfig, on_step: StepHook | None = None) -> SimResult:
    """Run ``config.steps`` training steps on the virtual clock (see the module docstring);
    ``on_step(version, pipeline)`` is awaited after each step (to change lengths, rebalance)."""
    rollout = SpanRecorder("rollout")
    device = SharedDevice()
    engines = [TracedSimEngine(config.engine, rollout, f"replica{i}", device) for i in range(config.replicas)]
    pipeline = CostedTrainerPipeline(
        engines,
        sim_prompts(max(4 * config.prompts_per_step, 256), prompt_len=config.prompt_len, seed=config.seed),
        group_size=config.group_size,
        max_new_tokens=config.max_new_tokens,
        weight_update=config.weight_update,
        reward=SimReward(config.reward_latency_s, workers=config.reward_workers),
        stagger=config.stagger,
        seed=config.seed,
        cost=config.trainer,
        streaming=config.mode != "sync",
        prompt_len=config.prompt_len,
        device=device,
    )
    pipeline.rollout_recorder = rollout
    ledger = GroupLedger(StalenessGate(config.prompts_per_step, config.staleness))
    controller = Controller(pipeline, PushAdmission(pipeline, ledger, config.prompts_per_step))
    ends: list[float] = []

    async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
        ends.append(asyncio.get_running_loop().time())
        if on_step is not None:
            await on_step(version, pipeline)
        return True

    run_virtual(controller.run(config.steps, after_step))
    return _result(config, pipeline.traced, pipeline, ledger, ends, rollout)


def _result(
    config: SimConfig,
    engines: Sequence[TracedSimEngine],
    pipeline: CostedTrainerPipeline,
    ledger: GroupLedger,
    ends: list[float],
    rollout: SpanRecorder,
) -> SimResult:
    durations = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
    measured = durations[config.warmup_steps :]
    step_s = sum(measured) / len(measured)
    wall = ends[-1]
    busy = sum(e.stats()["busy_s"] + e.stats()["weight_load_s"] for e in engines)
    prefill = sum(e.stats()["prefill_tokens"] for e in engines) * config.engine.prefill_s_per_token
    return SimResult(
        step_s=step_s,
        step_times=tuple(durations),
        generation_utilisation=min(1.0, (busy + prefill) / sum(wall - e.created_at for e in engines)),
        trainer_utilisation=min(1.0, pipeline.train_busy_s / wall),
        exposed_sync_s=stalled_together_s(engines) / len(durations),
        samples_per_s=config.prompts_per_step * config.group_size / step_s,
        staleness=dict(sorted(ledger.staleness.items())),
        counters=ledger.counters(),
        events=rollout.events() + pipeline.recorder.events(),
    )
