"""A trainer sharing its device with the replicas (``TrainerCost.alone_speedup``): its work runs at
the contended rate while a replica works and faster while none does, exactly; the simulator's
invariants still hold with it; and the default (1) changes nothing."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import pytest

from sluice.sim.clock import run_virtual
from sluice.sim.contention import SharedDevice
from sluice.sim.cost_model import TrainerCost
from sluice.sim.engine import LengthModel, SimEngineConfig
from sluice.sim.simulate import SimConfig, SimResult, simulate

ENGINE = SimEngineConfig(decode_s=0.02, knee=8, max_running=24, prefill_s_per_token=1e-4, load_s=0.5,
                         lengths=LengthModel(30, 0.5, 0.8))  # fmt: skip
TRAINER = TrainerCost(token_s=2e-4, microbatch_overhead_s=0.05, micro_batch_tokens=512, step_s=0.3)
ROLLOUT_SPANS = ("decode", "prefill", "weight_load")


def _config(speedup: float = 1.0, **kw) -> SimConfig:
    base = dict(engine=ENGINE, trainer=replace(TRAINER, alone_speedup=speedup), replicas=2, prompts_per_step=4,
                group_size=4, max_new_tokens=400, prompt_len=16, steps=6)  # fmt: skip
    return SimConfig(**{**base, **kw})


def _spend_with_replica_working(work_s: float, speedup: float, working: tuple[float, float] | None) -> float:
    """Virtual seconds ``spend`` takes while one replica works over ``working`` = (from, to)."""
    device = SharedDevice()

    async def replica(start: float, end: float) -> None:
        await asyncio.sleep(start)
        device.start()
        await asyncio.sleep(end - start)
        device.stop()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        task = loop.create_task(replica(*working)) if working is not None else None
        await asyncio.sleep(0)  # the replica starts first when its interval begins at 0
        await device.spend(work_s, speedup)
        if task is not None:
            task.cancel()
        return loop.time()

    return run_virtual(main())


def test_spend_runs_alone_overlapped_and_mixed_at_the_right_rates():
    assert _spend_with_replica_working(1.0, 2.0, None) == pytest.approx(0.5)  # alone: 2x
    assert _spend_with_replica_working(1.0, 2.0, (0.0, 5.0)) == pytest.approx(1.0)  # overlapped throughout
    # 0.4 s beside the replica (0.4 of work), then alone: the 0.6 left at 2x takes 0.3 s
    assert _spend_with_replica_working(1.0, 2.0, (0.0, 0.4)) == pytest.approx(0.7)
    # alone until the replica starts at 0.2 (0.4 of work), then beside it: 0.6 s more
    assert _spend_with_replica_working(1.0, 2.0, (0.2, 5.0)) == pytest.approx(0.8)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _trainer_spans(result: SimResult) -> list[tuple[float, float, float]]:
    """(duration, seconds beside a working replica, contended cost) of every trainer span, in s."""
    busy = _union([(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in result.events
                   if e.get("ph") == "X" and e["name"] in ROLLOUT_SPANS])  # fmt: skip
    out = []
    for e in result.events:
        if e.get("ph") != "X" or e["name"] not in ("train_microbatch", "optimizer_step"):
            continue
        start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        beside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
        if e["name"] == "optimizer_step":
            cost = TRAINER.step_s
        else:
            cost = TRAINER.microbatch_overhead_s + e["args"]["tokens"] * TRAINER.token_s
        out.append((end - start, beside, cost))
    return out


def test_every_trainer_span_takes_its_cost_at_the_rate_of_the_moment():
    speedup = 3.0
    spans = [s for mode in ("streaming", "async") for s in _trainer_spans(simulate(_config(speedup, mode=mode)))]
    for duration, beside, cost in spans:
        assert beside + speedup * (duration - beside) == pytest.approx(cost, abs=1e-6)
    # the run has spans fully alone (3x faster), fully beside decoding (the contended cost) and mixed
    assert any(beside == 0 and duration == pytest.approx(cost / speedup, abs=1e-6) for duration, beside, cost in spans)
    assert any(duration == pytest.approx(cost, abs=1e-6) and beside > 0 for duration, beside, cost in spans)
    assert any(1e-6 < beside < duration - 1e-6 for duration, beside, _ in spans)


def test_sync_trainer_never_overlaps_so_it_runs_alone_throughout():
    base, shared = simulate(_config(1.0, mode="sync")), simulate(_config(2.0, mode="sync"))
    spans = _trainer_spans(shared)
    assert all(beside == 0 for _, beside, _ in spans)
    assert sum(d for d, _, _ in spans) == pytest.approx(0.5 * sum(d for d, _, _ in _trainer_spans(base)), rel=1e-6)
    assert shared.step_s < base.step_s


def test_default_is_a_device_of_its_own():
    assert TrainerCost(token_s=1e-4).alone_speedup == 1.0
    result = simulate(_config(1.0, mode="streaming"))
    assert all(duration == pytest.approx(cost, abs=1e-6) for duration, _, cost in _trainer_spans(result))
    with pytest.raises(ValueError, match="alone_speedup"):
        TrainerCost(token_s=1e-4, alone_speedup=0.0)


@pytest.mark.parametrize("mode", ["sync", "streaming", "async"])
def test_invariants_hold_on_a_shared_device(mode):
    config = _config(2.5, mode=mode, eta=2)
    result = simulate(config)
    counters = result.counters
    assert counters["groups_trained"] == config.steps * config.prompts_per_step
    assert sum(result.staleness.values()) == counters["groups_trained"]
    assert max(result.staleness) <= config.staleness
    times = [simulate(_config(2.5, mode=mode, eta=2, replicas=n)).step_s for n in (1, 2, 4, 8)]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(times)), times
