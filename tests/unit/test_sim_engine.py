"""SimEngine: the cost model (knee, KV cap, prefill), long-tailed correlated lengths, versions
under interrupt / defer, abort, and determinism on the virtual clock."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from sluice.api import GenerationRequest, SamplingParams, VersionedEngine
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual


def _req(rid: str, prompt: tuple[int, ...] = (1, 2), max_new: int = 100_000, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_new), seed=seed)


def _fixed(length: int, **kwargs) -> SimEngineConfig:
    """Every response exactly ``length`` tokens; no prefill or load cost unless given."""
    lengths = LengthModel(median=length, prompt_sigma=0.0, sample_sigma=0.0)
    return SimEngineConfig(**{"prefill_s_per_token": 0.0, "load_s": 0.0, "lengths": lengths, **kwargs})


def _makespan(config: SimEngineConfig, n: int) -> float:
    async def main() -> float:
        engine = SimEngine(config)
        await asyncio.gather(*(engine.generate(_req(f"r{i}", seed=i)) for i in range(n)))
        return asyncio.get_running_loop().time()

    return run_virtual(main())


def test_is_an_inference_engine() -> None:
    assert isinstance(SimEngine(), VersionedEngine)


def test_iteration_time_grows_past_the_knee_and_the_cap_queues() -> None:
    base = _fixed(100, decode_s=0.01, knee=4, max_running=64)
    assert _makespan(base, 1) == pytest.approx(1.0)
    assert _makespan(base, 4) == pytest.approx(1.0)  # up to the knee: flat
    assert _makespan(base, 16) == pytest.approx(4.0)  # 4x the knee: 4x per token
    capped = _fixed(100, decode_s=0.01, knee=4, max_running=4)
    assert _makespan(capped, 16) == pytest.approx(4.0)  # 4 waves of 4 at the flat rate
    prefill = _fixed(100, decode_s=0.01, prefill_s_per_token=0.1)
    assert _makespan(prefill, 3) == pytest.approx(1.0 + 0.2)  # one shared 2-token prompt


def test_lengths_long_tailed_and_correlated_within_a_prompt() -> None:
    model = LengthModel(median=200, prompt_sigma=1.0, sample_sigma=0.8, seed=3)
    groups = [[math.log(model.length((p, p + 1, 7), seed=p * 100 + k)) for k in range(16)] for p in range(300)]
    within = statistics.mean(statistics.variance(g) for g in groups)
    between = statistics.variance(statistics.mean(g) for g in groups)
    assert within == pytest.approx(0.8**2, rel=0.15)
    assert between == pytest.approx(1.0**2 + 0.8**2 / 16, rel=0.25)
    flat = sorted(math.exp(x) for g in groups for x in g)
    p50, p99 = flat[len(flat) // 2], flat[int(len(flat) * 0.99)]
    assert p50 == pytest.approx(200, rel=0.15) and 12 < p99 / p50 < 35
    assert model.length((1, 2, 7), seed=5) == LengthModel(median=200, seed=3).length((1, 2, 7), seed=5)


def test_measured_prompt_lengths_keep_a_two_kind_task_and_set_the_longest_response() -> None:
    """A task of short (6-token) and long (24-token) prompts, 30 % long, given as a measured
    distribution: prompts draw exactly those kinds in that share (no log-normal holds two kinds),
    a prompt's samples share its kind, and a wave of 8 prompts decodes until its longest response."""
    kinds = (6.0,) * 7 + (24.0,) * 3
    model = LengthModel(median=7, prompt_sigma=0.0, sample_sigma=0.0, prompt_lengths=kinds)
    drawn = [[model.length((p, 11, 3), seed=p * 10 + k) for k in range(4)] for p in range(2000)]
    assert all(len(set(g)) == 1 and g[0] in (6, 24) for g in drawn)
    assert sum(g[0] == 24 for g in drawn) / len(drawn) == pytest.approx(0.3, abs=0.04)
    config = SimEngineConfig(decode_s=1.0, knee=1000, max_running=64, prefill_s_per_token=0.0, lengths=model)

    async def wave(w: int) -> tuple[float, int]:
        engine = SimEngine(config)
        reqs = [_req(f"w{w}-{p}-{k}", (w, p, 5), seed=k) for p in range(8) for k in range(4)]
        await asyncio.gather(*(engine.generate(r) for r in reqs))
        return engine.stats()["steps"], max(model.length(r.prompt_ids, r.seed) for r in reqs)

    waves = [run_virtual(wave(w)) for w in range(30)]
    assert all(steps == longest for steps, longest in waves)
    assert sum(longest == 24 for _, longest in waves) / len(waves) > 0.8  # 1 - 0.7**8 = 94 % expected


def test_interrupt_versions_and_logprobs_follow_the_weights_that_sampled_each_token() -> None:
    async def main():
        engine = SimEngine(_fixed(100, decode_s=0.01, load_s=0.25, prefill_s_per_token=0.001))
        running = [asyncio.ensure_future(engine.generate(_req(f"r{i}", seed=i))) for i in range(2)]
        await asyncio.sleep(0.305)  # 30 tokens done, the 31st in progress
        engine.update_weights({}, version=1, mode="interrupt")
        done = await asyncio.gather(*running)
        return done, engine.stats(), asyncio.get_running_loop().time()

    done, stats, end = run_virtual(main())
    for i, c in enumerate(done):
        assert c.versions == (0,) * 31 + (1,) * 69 and c.finish_reason == "stop"
        assert c.logprobs == SimEngine.behaviour_logprobs(i, c.versions)
        assert c.logprobs[:31] == SimEngine.behaviour_logprobs(i, (0,) * 100)[:31]  # version 0's stream
        assert c.logprobs[31:] == SimEngine.behaviour_logprobs(i, (1,) * 100)[31:]  # then version 1's
        assert c.logprobs[31:] != SimEngine.behaviour_logprobs(i, (0,) * 100)[31:]
        assert c.token_ids == SimEngine.tokens(i, 100, 32000)
    reprefill = 2 * (2 + 31)
    assert stats["reprefill_tokens"] == reprefill and stats["weight_updates"] == 1
    assert stats["weight_load_s"] == pytest.approx(0.25 + reprefill * 0.001)
    assert end == pytest.approx(0.002 + 1.0 + stats["weight_load_s"])


@pytest.mark.parametrize("mode", ["defer", "staggered"])
def test_defer_drains_on_old_weights_then_swaps(mode) -> None:
    async def main():
        engine = SimEngine(_fixed(50, decode_s=0.01, max_running=1, load_s=0.1))
        first = asyncio.ensure_future(engine.generate(_req("a")))
        await asyncio.sleep(0.2)
        engine.update_weights({}, version=1, mode=mode)
        second = asyncio.ensure_future(engine.generate(_req("b", seed=1)))
        await asyncio.sleep(0)
        staged = engine.stats()
        return await first, await second, staged, engine.stats()

    a, b, staged, stats = run_virtual(main())
    assert staged["version"] == 0 and staged["pending_version"] == 1
    assert a.versions == (0,) * 50 and b.versions == (1,) * 50
    assert stats["weight_drain_s"] == pytest.approx(0.3) and stats["weight_load_s"] == pytest.approx(0.1)


def test_abort_returns_the_partial_response_and_newer_update_supersedes() -> None:
    async def main():
        engine = SimEngine(_fixed(100, decode_s=0.01))
        task = asyncio.ensure_future(engine.generate(_req("a")))
        queued = asyncio.ensure_future(engine.generate(_req("b")))
        await asyncio.sleep(0.105)
        engine.abort("a")
        engine.update_weights({}, version=1, mode="defer")
        engine.update_weights({}, version=2, mode="defer")
        return await task, await queued, engine.stats()

    a, b, stats = run_virtual(main())
    assert a.finish_reason == "abort" and len(a.token_ids) == 11
    assert b.versions == (0,) * 100  # it was running: drained on the old weights
    assert stats["version"] == 2 and stats["weight_updates"] == 1 and stats["weight_updates_superseded"] == 1


def test_deterministic_under_a_seed() -> None:
    def run() -> tuple:
        async def main():
            engine = SimEngine(SimEngineConfig(max_running=8, knee=4, lengths=LengthModel(median=64, seed=7)))
            tasks = [asyncio.ensure_future(engine.generate(_req(f"r{i}", (i % 5, 1), 500, seed=i))) for i in range(24)]
            await asyncio.sleep(0.4)
            engine.update_weights({}, 1, "interrupt")
            return tuple(await asyncio.gather(*tasks)), asyncio.get_running_loop().time()

        return run_virtual(main())

    first, second = run(), run()
    assert first == second
    assert {v for c in first[0] for v in c.versions} == {0, 1}


def test_stalled_together_counts_only_time_every_engine_is_updating() -> None:
    from sluice.sim.pipeline import stalled_together_s

    a, b = SimEngine(), SimEngine()
    a.update_windows += [(0.0, 2.0), (5.0, 6.0)]
    b.update_windows += [(1.0, 3.0), (6.0, 7.0)]
    assert stalled_together_s([a, b]) == pytest.approx(1.0)  # [1, 2]; touching windows do not overlap
    assert stalled_together_s([a]) == pytest.approx(3.0)
