"""The rebalancer's control loop on simulated replicas: a pipeline simulation whose response
lengths change at a given step, with or without sluice's ``Rebalancer``
(``sluice/schedule/rebalance.py``, the rule ``fleet.rebalance`` runs) acting through the real
``LLMProxy``. It measures, after each step, the replicas' busy seconds per replica (generation)
and the trainer's busy seconds (training), the numbers a real run's step metrics and trace give,
and records per-step rows for plots and tests.

It does not decide anything itself (the product's ``Rebalancer`` does) and is not used by real runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sluice.schedule.rebalance import RebalanceEvent, Rebalancer, RebalanceRule
from sluice.sim.engine import LengthModel
from sluice.sim.simulate import CostedTrainerPipeline, SimConfig, SimResult, TracedSimEngine, simulate


@dataclass(frozen=True)
class StepRow:
    step: int
    step_s: float
    replicas: int
    generation_s: float
    train_s: float


@dataclass(frozen=True)
class RebalanceRun:
    result: SimResult
    rows: list[StepRow]
    events: list[RebalanceEvent]


def run_with_shift(
    config: SimConfig, *, shift_at: int, lengths: LengthModel, rebalance: RebalanceRule | None
) -> RebalanceRun:
    """Simulate ``config``; after step ``shift_at`` every replica (and every later one) draws
    response lengths from ``lengths``. With ``rebalance``, a ``Rebalancer`` adds or removes
    replicas after each step."""
    rows: list[StepRow] = []
    marks = {"t": 0.0, "busy": 0.0, "train": 0.0}
    holder: dict[str, Rebalancer] = {}

    async def on_step(version: int, pipeline: CostedTrainerPipeline) -> None:
        import asyncio

        now = asyncio.get_running_loop().time()
        busy = sum(e.stats()["busy_s"] + e.stats()["weight_load_s"] for e in pipeline.traced)
        replicas = len(pipeline.proxy.replica_ids)
        generation = (busy - marks["busy"]) / replicas
        train = pipeline.train_busy_s - marks["train"]
        row = StepRow(version, now - marks["t"], replicas, generation, train)
        rows.append(row)
        marks.update(t=now, busy=busy, train=pipeline.train_busy_s)
        if version == shift_at:
            shifted = replace(pipeline.traced[0].config, lengths=lengths)
            for engine in pipeline.traced:
                engine.config = shifted
        if rebalance is not None and version > 1:  # as in a run, the first step (start-up) is not judged
            rebalancer = holder.setdefault("r", Rebalancer(rebalance))
            change = rebalancer.observe(version, row.step_s, generation, train, replicas)
            for _ in range(change):
                await pipeline.proxy.add_replica(_new_engine(pipeline))
            if change < 0:
                await pipeline.proxy.remove_replica(pipeline.proxy.replica_ids[-1])

    result = simulate(config, on_step)
    return RebalanceRun(result, rows, holder["r"].events if holder else [])


def _new_engine(pipeline: CostedTrainerPipeline) -> TracedSimEngine:
    """A replica to add at run time (``LLMProxy.add_replica``), traced and accounted, with the
    replicas' current config (a step hook may have changed it, e.g. to lengthen responses)."""
    config = pipeline.traced[0].config
    engine = TracedSimEngine(config, pipeline.rollout_recorder, f"replica{len(pipeline.engines)}", pipeline.device)
    pipeline.engines.append(engine)
    pipeline.traced.append(engine)
    return engine
