"""Rebalancing a run's rollout replicas after each step (``fleet.rebalance``, StreamRL §4).

After a step it reads the step's measured times — the time in the trainer's calls
(``step_train_s``) and the time the step waited for generation (``step_wait_generation_s``), both
from push admission — and the proxy's busy replica-seconds since the last step (``busy_s``, per
replica: generation's time); ``schedule/rebalance.py``'s ``Rebalancer`` decides, the pipeline's
``resize_rollout`` adds replicas or removes one, and each change is a ``rebalance`` record with its
reason in ``metrics.jsonl``. The first step is not judged (it carries the run's start-up). The
count after each decision goes into the run's checkpoints; ``restore_replicas`` brings a
resumed run's rollout back to it. It
decides nothing itself and moves no sample: the proxy continues a removed replica's requests
elsewhere.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Protocol

from sluice.config import SluiceConfig
from sluice.schedule.rebalance import Rebalancer, RebalanceRule
from sluice.telemetry.metrics import JsonlMetrics


class Resizable(Protocol):
    """What rebalancing asks of the pipeline."""

    async def engine_stats(self) -> dict[str, float]: ...

    async def resize_rollout(self, change: int) -> int: ...


def rebalance_rule(config: SluiceConfig) -> RebalanceRule:
    """The rule ``fleet.rebalance_*``, ``resources.rollout.{min,max}_replicas`` and ``run.mode``
    (whether generation overlaps training, for the step model) describe."""
    fleet, rollout = config.fleet, config.resources.rollout
    return RebalanceRule(
        min_replicas=rollout.min_replicas,
        max_replicas=rollout.max_replicas or rollout.replicas,
        window=fleet.rebalance_window,
        cooldown=fleet.rebalance_cooldown,
        overlapped=config.run.mode == "async",
    )


class RunRebalancer:
    """Measures each step, asks the ``Rebalancer``, applies its change (module docstring)."""

    def __init__(self, rule: RebalanceRule, pipeline: Resizable, metrics: JsonlMetrics) -> None:
        self.rebalancer = Rebalancer(rule)
        self.pipeline = pipeline
        self.metrics = metrics
        self._busy_s: float | None = None
        self._logged = 0
        self._warm = False  # the first step carries the run's start-up (engines, reward pool)
        self.replicas: int | None = None
        """The replicas after the last step judged (the run checkpoints them)."""

    async def start(self) -> None:
        """Mark the proxy's busy time before the first step (evaluation is not generation)."""
        self._busy_s = (await self.pipeline.engine_stats()).get("proxy_busy_s", 0.0)

    async def after_step(self, step: int, metrics: dict[str, float]) -> int:
        """Judge step ``step`` from its ``metrics``; returns the change applied (replicas added, -1 or 0)."""
        stats = await self.pipeline.engine_stats()
        busy, replicas = stats["proxy_busy_s"], int(stats["proxy_replicas"])
        generation_s = (busy - (self._busy_s or 0.0)) / max(replicas, 1)
        self._busy_s, self.replicas = busy, replicas
        if not self._warm:
            self._warm = True
            return 0
        train_s, waited = metrics["step_train_s"], metrics["step_wait_generation_s"]
        change = self.rebalancer.observe(step, train_s + waited, generation_s, train_s, replicas)
        if change:
            replicas = self.replicas = await self.pipeline.resize_rollout(change)
        for event in self.rebalancer.events[self._logged :]:
            self.metrics.log("rebalance", **{**asdict(event), "replicas": replicas if event.change else event.replicas})
        self._logged = len(self.rebalancer.events)
        return change


async def restore_replicas(rule: RebalanceRule, pipeline: Resizable, replicas: int) -> int:
    """A resumed run's rollout back at the ``replicas`` its checkpoint kept (within the rule's
    bounds); returns the replicas now."""
    now = int((await pipeline.engine_stats())["proxy_replicas"])
    wanted = min(max(replicas, rule.min_replicas), rule.max_replicas)
    return await pipeline.resize_rollout(wanted - now) if wanted != now else now
