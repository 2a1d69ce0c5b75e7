"""LLMProxy with longest-predicted-first dispatch (virtual clock, simulated replicas): free slots go
to the longest predicted request, so a long request no longer starts last; the predictor learns
from finished responses only; aborts, pauses and removed replicas still hold."""

from __future__ import annotations

import asyncio

import pytest

from fakes import FakeLengthPredictor
from sluice.api import GenerationRequest, SamplingParams
from sluice.rollout.length_ranker import OnlineLengthRanker
from sluice.rollout.proxy import LLMProxy
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual

# responses always run to their budget (the length model's median is far above it), so a
# request's max_new_tokens is its true length; 0.01 s per decode iteration up to 8 running
CAPPED = SimEngineConfig(decode_s=0.01, knee=8, prefill_s_per_token=0.0, load_s=0.0, lengths=LengthModel(1e6, 0, 0))
LENGTHS = {(1, 1): 10, (2, 2): 10, (3, 3): 10, (4, 4): 10, (5, 5): 100}  # the long one arrives last


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"p{p[0]}", p, SamplingParams(n), seed=i) for i, (p, n) in enumerate(LENGTHS.items())]


def _finish_times(proxy: LLMProxy) -> dict[str, float]:
    async def main():
        loop = asyncio.get_running_loop()
        times: dict[str, float] = {}

        async def one(request):
            completion = await proxy.generate(request)
            times[request.request_id] = loop.time()
            return completion

        done = await asyncio.gather(*(one(r) for r in _requests()))
        assert all(c.finish_reason == "length" for c in done)
        return times

    return run_virtual(main())


def test_longest_predicted_first_shortens_the_makespan() -> None:
    fifo = _finish_times(LLMProxy([SimEngine(CAPPED)]))  # the engine's FIFO queue holds the rest
    predictor = FakeLengthPredictor({p: float(n) for p, n in LENGTHS.items()})
    proxy = LLMProxy([SimEngine(replace_cap(CAPPED, 2))], length_predictor=predictor, slots=2)
    lpt = _finish_times(proxy)
    assert max(fifo.values()) == pytest.approx(1.0, abs=0.05)  # everything at once: 100 iterations
    # two slots: FIFO would start the long one after two rounds of short ones (1.2 s); LPT starts
    # it at once and runs the four short ones beside it
    fifo_two = _finish_times(LLMProxy([SimEngine(replace_cap(CAPPED, 2))]))
    assert max(fifo_two.values()) == pytest.approx(1.2, abs=0.05)
    assert max(lpt.values()) == pytest.approx(1.0, abs=0.05) and lpt["p1"] == pytest.approx(0.1, abs=0.02)
    assert sorted(predictor.observed) == sorted((p, n) for p, n in LENGTHS.items())
    assert proxy.stats()["lpt_observed"] == 5 and proxy.stats()["lpt_waiting"] == 0


def replace_cap(config: SimEngineConfig, slots: int) -> SimEngineConfig:
    from dataclasses import replace

    return replace(config, max_running=slots)


def test_abort_and_pause_while_held_in_the_queue() -> None:
    predictor = FakeLengthPredictor({}, default=50.0)
    engine = SimEngine(replace_cap(CAPPED, 1))
    proxy = LLMProxy([engine], length_predictor=predictor, slots=1)

    async def main():
        first = asyncio.ensure_future(proxy.generate(GenerationRequest("a", (1,), SamplingParams(50), seed=0)))
        held = asyncio.ensure_future(proxy.generate(GenerationRequest("b", (2,), SamplingParams(50), seed=1)))
        await asyncio.sleep(0.1)
        assert proxy.stats()["lpt_waiting"] == 1 and engine.stats()["waiting"] == 0  # held at the proxy
        proxy.abort("b")
        aborted = await held
        proxy.pause()
        third = asyncio.ensure_future(proxy.generate(GenerationRequest("c", (3,), SamplingParams(50), seed=2)))
        await first  # "a" was running: pause holds decoding, so resume first
        return aborted, third

    async def run():
        task = asyncio.ensure_future(main())
        await asyncio.sleep(1.0)
        proxy.resume()
        aborted, third = await task
        return aborted, await third

    aborted, third = run_virtual(run())
    assert aborted.finish_reason == "abort" and aborted.token_ids == ()
    assert third.finish_reason == "length" and len(third.token_ids) == 50
    assert [p for p, _ in predictor.observed] == [(1,), (3,)]  # the aborted one taught nothing


def test_online_ranker_learns_on_the_live_path_and_removal_loses_nothing() -> None:
    engines = [SimEngine(replace_cap(CAPPED, 4)) for _ in range(3)]
    ranker = OnlineLengthRanker(buckets=8)
    proxy = LLMProxy(engines[:2], length_predictor=ranker, slots=4)
    requests = [GenerationRequest(f"r{i}", (i % 5, 7), SamplingParams(20 + 10 * (i % 5)), seed=i) for i in range(24)]

    async def main():
        tasks = [asyncio.ensure_future(proxy.generate(r)) for r in requests]
        await asyncio.sleep(0.15)
        await proxy.add_replica(engines[2])
        assert await proxy.remove_replica(0) > 0
        return await asyncio.gather(*tasks)

    done = run_virtual(main())
    assert [len(c.token_ids) for c in done] == [r.params.max_new_tokens for r in requests]
    assert ranker.observed == 24 and proxy.stats()["rerouted"] > 0
    short, long = ranker.predict([(0, 7), (4, 7)])
    assert long > short  # it learned the prompts' lengths from what the replicas produced
    with pytest.raises(ValueError, match="slots"):
        LLMProxy(engines, length_predictor=ranker)


def test_sim_pipeline_passes_the_predictor_to_its_proxy() -> None:
    from sluice.sim.pipeline import SimPipeline
    from sluice.sim.task import sim_prompts

    engines = [SimEngine(replace_cap(CAPPED, 3)) for _ in range(2)]
    pipeline = SimPipeline(
        engines, sim_prompts(4), group_size=2, max_new_tokens=8, length_predictor=FakeLengthPredictor({})
    )
    assert pipeline.proxy.slots == 3 and pipeline.proxy.stats()["lpt_waiting"] == 0
    assert "lpt_waiting" not in SimPipeline(engines, sim_prompts(4), group_size=2, max_new_tokens=8).proxy.stats()


def test_released_request_aborted_or_cancelled_before_it_runs_gives_its_slot_back() -> None:
    engine = SimEngine(replace_cap(CAPPED, 1))
    proxy = LLMProxy([engine], length_predictor=FakeLengthPredictor({}, default=5.0), slots=1)

    async def main():
        first = asyncio.ensure_future(proxy.generate(GenerationRequest("a", (1,), SamplingParams(5), seed=0)))
        await asyncio.sleep(0)  # queued
        await asyncio.sleep(0)  # released (its slot reserved), not yet running
        proxy.abort("a")
        aborted = await first
        second = asyncio.ensure_future(proxy.generate(GenerationRequest("b", (2,), SamplingParams(5), seed=1)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        second.cancel()
        third = await asyncio.wait_for(proxy.generate(GenerationRequest("c", (3,), SamplingParams(5), seed=2)), 10)
        return aborted, third

    aborted, third = run_virtual(main())
    assert aborted.finish_reason == "abort" and aborted.token_ids == ()
    assert third.finish_reason == "length" and len(third.token_ids) == 5  # the slot was given back twice
    assert proxy._states[0].reserved == 0
