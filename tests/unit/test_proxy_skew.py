"""Skewness-aware dispatch on the live path (virtual clock, simulated replicas): the requests the
ranker predicts to be in the long tail run on dedicated replicas under a smaller cap, the rest on
the others; the long tail then decodes in small, fast batches; abort, pause / resume, weight
updates and replicas added or removed mid-flight lose no request."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from fakes import FakeLengthPredictor, RecordingEngine
from sluice.api import GenerationRequest, SamplingParams
from sluice.config.fleet import FleetConfig, check_fleet
from sluice.rollout.proxy import LLMProxy
from sluice.rollout.skew_dispatch import LongTailSplit, long_tail_split
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual

# every response runs to its budget (the length model's median is far above it), so a request's
# max_new_tokens is its true length; 0.01 s per decode iteration up to 2 running, linear beyond
KNEE2 = SimEngineConfig(
    decode_s=0.01, knee=2, max_running=64, prefill_s_per_token=0.0, load_s=0.02, lengths=LengthModel(1e6, 0, 0)
)


def _request(i: int, length: int) -> GenerationRequest:
    return GenerationRequest(f"r{i}", (i,), SamplingParams(length), seed=i)


def _run_all(proxy: LLMProxy, requests: list[GenerationRequest]) -> tuple[list, float]:
    async def main():
        done = await asyncio.gather(*(proxy.generate(r) for r in requests))
        return done, asyncio.get_running_loop().time()

    return run_virtual(main())


def _proxy(engines, lengths: dict[int, int], split: LongTailSplit | None, slots: int = 16) -> LLMProxy:
    predictor = FakeLengthPredictor({(i,): float(n) for i, n in lengths.items()})
    return LLMProxy(engines, length_predictor=predictor, slots=slots, long_tail=split)


def test_long_tail_runs_on_the_dedicated_replica_under_its_cap() -> None:
    lengths = {i: 100 if i < 8 else 10 for i in range(40)}  # the long ones arrive first
    engines = [RecordingEngine(SimEngine(KNEE2)) for _ in range(4)]
    proxy = _proxy(engines, lengths, LongTailSplit(1, 2, share=0.2))
    done, _ = _run_all(proxy, [_request(i, n) for i, n in lengths.items()])
    assert [len(c.token_ids) for c in done] == list(lengths.values())  # nothing lost or cut
    assert sorted(engines[0].served) == sorted(f"r{i}" for i in range(8))  # the whole long tail
    assert engines[0].peak == 2  # ran at its small cap, never above
    assert all(e.peak <= 16 for e in engines) and not any(r in e.served for e in engines[1:] for r in engines[0].served)
    stats = proxy.stats()
    assert stats["long_tail_routed"] == 8 and stats["long_tail_replicas"] == 1 and stats["lpt_waiting"] == 0


def test_small_batches_for_the_long_tail_shorten_the_makespan() -> None:
    lengths = {0: 100, 1: 100, **{i: 10 for i in range(2, 16)}}
    requests = [_request(i, n) for i, n in lengths.items()]
    # plain longest-first: each replica decodes a long one beside 7 short ones at 4x the per-token
    # time (0.4 s), then the long one alone for 90 iterations: 1.3 s
    _, plain = _run_all(_proxy([SimEngine(KNEE2) for _ in range(2)], lengths, None, slots=8), requests)
    # split: both long ones on replica 0 at batch 2 (0.01 s per token: 1.0 s); the 14 short ones on
    # replica 1, 8 then 6 at a time (0.4 + 0.3 s)
    _, split = _run_all(_proxy([SimEngine(KNEE2) for _ in range(2)], lengths, LongTailSplit(1, 2), slots=8), requests)
    assert plain == pytest.approx(1.3, abs=0.02) and split == pytest.approx(1.0, abs=0.02)


def test_split_classifies_against_recent_requests_as_the_ranker_sees_them_now() -> None:
    split = LongTailSplit(2, 4, share=0.2, window=10)
    ranker = FakeLengthPredictor({(n,): float(n) for n in range(1, 11)})
    assert not split.is_tail((5,), ranker)  # nothing recorded: nothing is long tail
    for n in range(1, 11):
        split.record((n,))
    assert [n for n in range(1, 11) if split.is_tail((n,), ranker)] == [9, 10]  # the top 20 %
    ranker.table = {(n,): 1.0 for n in range(1, 11)}  # it learned: every recent prompt is alike now
    split.record((1,))
    assert not any(split.is_tail((n,), ranker) for n in range(1, 11))  # re-predicted, not remembered
    ranker.table[(11,)] = 5.0
    assert split.is_tail((11,), ranker)
    for _ in range(10):
        split.record((11,))  # the window forgets older requests
    assert not split.is_tail((11,), ranker)


def test_split_caps_and_pools_fall_back_when_a_side_is_empty() -> None:
    split = LongTailSplit(2, 4)
    assert [split.join(r) for r in (0, 1, 2)] == [True, True, False]
    assert split.cap(0, 16) == 4 and split.cap(2, 16) == 16 and split.cap(1, 2) == 2
    assert split.pool([0, 1, 2], tail=True) == [0, 1] and split.pool([0, 1, 2], tail=False) == [2]
    split.leave(0)
    split.leave(1)
    assert split.pool([2], tail=True) == [2]  # no dedicated replica left: the long tail goes anywhere
    with pytest.raises(ValueError, match="share"):
        LongTailSplit(1, 4, share=1.0)


def test_abort_pause_weights_and_replicas_in_and_out_lose_nothing() -> None:
    lengths = {i: (80 if i % 5 == 0 else 12 + i % 7) for i in range(40)}
    lengths.update({100 + i: (90 if i % 4 == 0 else 15) for i in range(12)})  # after the new replica
    engines = [RecordingEngine(SimEngine(KNEE2)) for _ in range(4)]
    proxy = _proxy(engines[:3], lengths, LongTailSplit(1, 2, share=0.2), slots=4)

    async def main():
        first = [asyncio.ensure_future(proxy.generate(_request(i, lengths[i]))) for i in range(40)]
        await asyncio.sleep(0.05)
        waiting = next(i for i in range(40) if i % 5 == 0 and f"r{i}" not in engines[0].served)
        proxy.abort("r0")  # running on the dedicated replica
        proxy.abort(f"r{waiting}")  # still held in the long-tail lane
        proxy.pause()
        await asyncio.sleep(0.2)
        proxy.resume()
        await proxy.sync_weights({}, 1, "staggered")
        await asyncio.sleep(0.05)
        moved = await proxy.remove_replica(0)  # the dedicated one: its lane falls back to the others
        await asyncio.sleep(0.1)
        new_id = await proxy.add_replica(engines[3])  # joins as the dedicated replica
        later = [asyncio.ensure_future(proxy.generate(_request(100 + i, lengths[100 + i]))) for i in range(12)]
        return await asyncio.gather(*first), await asyncio.gather(*later), moved, new_id, waiting

    first, later, moved, new_id, waiting = run_virtual(main())
    for completion in first + later:
        rid = int(completion.request_id[1:])
        if rid in (0, waiting):
            assert completion.finish_reason == "abort"
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == lengths[rid]
    assert moved > 0 and new_id == 3 and proxy.stats()["rerouted"] >= moved
    assert set(engines[3].served) <= {f"r{100 + i}" for i in range(12) if i % 4 == 0} and engines[3].served
    assert engines[3].peak <= 2 and engines[0].peak <= 2
    stats = proxy.stats()
    assert stats["in_flight"] == 0 and stats["lpt_waiting"] == 0 and stats["version"] == 1
    assert all(state.reserved == 0 for state in proxy._states.values())


def test_config_and_construction_refuse_what_cannot_work() -> None:
    with pytest.raises(ValueError, match=r"fleet\.lpt"):
        check_fleet(FleetConfig(long_tail_replicas=1), "local")
    assert long_tail_split(FleetConfig(lpt=True), 32) is None
    split = long_tail_split(FleetConfig(lpt=True, long_tail_replicas=2, long_tail_max_batch=64), 32)
    assert split is not None and (split.replicas, split.max_batch, split.share) == (2, 32, 0.2)
    engines = [SimEngine(KNEE2) for _ in range(2)]
    with pytest.raises(ValueError, match="length predictor"):
        LLMProxy(engines, long_tail=LongTailSplit(1, 2))
    with pytest.raises(ValueError, match="leave none"):
        LLMProxy(engines, length_predictor=FakeLengthPredictor({}), slots=4, long_tail=LongTailSplit(2, 2))


def test_sim_pipeline_passes_the_split_to_its_proxy() -> None:
    from sluice.sim.pipeline import SimPipeline
    from sluice.sim.task import sim_prompts

    engines = [SimEngine(replace(KNEE2, max_running=8)) for _ in range(3)]
    pipeline = SimPipeline(
        engines, sim_prompts(4), group_size=2, max_new_tokens=8, length_predictor=FakeLengthPredictor({}),
        long_tail=LongTailSplit(1, 2),
    )  # fmt: skip
    assert pipeline.proxy.stats()["long_tail_replicas"] == 1
