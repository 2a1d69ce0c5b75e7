"""LLMProxy over simulated replicas (virtual clock): routing, prompt replication, abort, pause,
replicas added and removed mid-flight without losing a request, and the three weight modes."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from sluice.api import GenerationRequest, InferenceEngine, SamplingParams
from sluice.rollout.proxy import LLMProxy
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual

FIXED = SimEngineConfig(decode_s=0.01, prefill_s_per_token=0.0, load_s=0.05, lengths=LengthModel(100, 0.0, 0.0))


def _req(rid: str, affinity: str | None = None, max_new: int = 10_000, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(rid, (1, 2), SamplingParams(max_new), seed=seed, affinity=affinity)


def _engines(n: int, config: SimEngineConfig = FIXED) -> list[SimEngine]:
    return [SimEngine(config) for _ in range(n)]


def test_is_an_inference_engine() -> None:
    assert isinstance(LLMProxy(), InferenceEngine)


@pytest.mark.parametrize("replication", [True, False])
def test_least_outstanding_routing_and_prompt_replication(replication) -> None:
    engines = _engines(4)
    proxy = LLMProxy(engines, prompt_replication=replication)

    async def main():
        groups = [[_req(f"g{g}-s{k}", affinity=f"g{g}") for k in range(4)] for g in range(2)]
        return await asyncio.gather(*(proxy.generate(r) for group in groups for r in group))

    done = run_virtual(main())
    assert all(c.finish_reason == "stop" and len(c.token_ids) == 100 for c in done)
    per_replica = [e.stats()["generated_tokens"] for e in engines]
    if replication:  # 8 samples over 4 replicas, least outstanding tokens first: 2 each
        assert per_replica == [200] * 4
    else:  # each group's samples share the replica its first sample went to
        assert per_replica == [400, 400, 0, 0]
    assert proxy.stats()["routed"] == 8 and proxy.stats()["in_flight"] == 0


def test_abort_pause_and_resume() -> None:
    engines = _engines(2)
    proxy = LLMProxy(engines)

    async def main():
        running = asyncio.ensure_future(proxy.generate(_req("a")))
        await asyncio.sleep(0.305)
        proxy.abort("a")
        aborted = await running
        proxy.pause()
        held = asyncio.ensure_future(proxy.generate(_req("b")))
        await asyncio.sleep(1.0)
        assert not held.done() and sum(e.stats()["waiting"] + e.stats()["running"] for e in engines) == 0
        proxy.resume()
        return aborted, await held, asyncio.get_running_loop().time()

    aborted, resumed, end = run_virtual(main())
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 31
    assert resumed.finish_reason == "stop" and end == pytest.approx(0.31 + 1.0 + 1.0)


def test_replicas_removed_and_added_mid_flight_lose_no_request() -> None:
    engines = _engines(3, SimEngineConfig(decode_s=0.01, max_running=4, lengths=LengthModel(80, 0.5, 0.5)))
    proxy = LLMProxy(engines[:2])

    async def main():
        tasks = [asyncio.ensure_future(proxy.generate(_req(f"r{i}", max_new=400, seed=i))) for i in range(16)]
        await asyncio.sleep(0.3)
        moved = await proxy.remove_replica(0)
        assert moved > 0 and proxy.replica_ids == [1]
        new_id = await proxy.add_replica(engines[2])
        await asyncio.sleep(0.3)
        assert await proxy.remove_replica(1) > 0  # now only the newcomer is left
        return moved, new_id, await asyncio.gather(*tasks)

    moved, new_id, done = run_virtual(main())
    assert new_id == 2 and len(done) == 16
    assert all(c.finish_reason in ("stop", "length") for c in done)
    stats = proxy.stats()
    assert stats["rerouted"] >= moved + 1 and stats["rerouted_tokens"] > 0
    assert stats["replicas_added"] == 1 and stats["replicas_removed"] == 2
    tokens = sum(len(c.token_ids) for c in done)
    assert tokens == sum(e.stats()["generated_tokens"] for e in engines)  # partial work was kept


def test_added_replica_gets_the_newest_weights_first() -> None:
    proxy = LLMProxy(_engines(1))
    late = SimEngine(FIXED)

    async def main():
        await proxy.sync_weights({"w": 1}, 3, "interrupt")
        await proxy.add_replica(late)
        while proxy.stats()["version"] < 3:  # the first replica swaps at its next boundary
            await asyncio.sleep(0.01)
        return late.stats()["version"], proxy.stats()["version"]

    assert run_virtual(main()) == (3.0, 3.0)


@pytest.mark.parametrize("mode", ["interrupt", "defer", "staggered"])
def test_settled_returns_once_every_replica_holds_the_new_version(mode) -> None:
    """``settled`` is what a rollout worker's ``load_version`` waits on in-process (instead of the
        driver polling it over Ray calls): with requests running, a deferred update is not held yet
        when ``sync_weights`` returns, and ``settled`` returns only when it is, on every replica (an
    interrupting load lands at each simulated replica's next step boundary)."""
    engines = _engines(2, SimEngineConfig(decode_s=0.01, load_s=0.05, lengths=LengthModel(100, 0.0, 0.0)))
    proxy = LLMProxy(engines)

    async def main():
        tasks = [asyncio.ensure_future(proxy.generate(_req(f"r{i}", seed=i))) for i in range(4)]
        await asyncio.sleep(0.3)
        await proxy.sync_weights({}, 1, mode)  # type: ignore[arg-type]
        before = [e.stats()["version"] for e in engines]
        held = await proxy.settled()
        after = [e.stats()["version"] for e in engines]
        await asyncio.gather(*tasks)
        return before, held, after

    before, held, after = run_virtual(main())
    assert held == 1.0 and after == [1.0, 1.0]
    if mode != "interrupt":  # a deferred swap waits for the running requests to drain
        assert before == [0.0, 0.0]


def _update_during(mode: str, replicas: int) -> tuple[list, list[SimEngine], list[float]]:
    engines = _engines(replicas, SimEngineConfig(decode_s=0.01, load_s=0.2, lengths=LengthModel(100, 0.0, 0.3)))
    proxy = LLMProxy(engines)
    accepting: list[float] = []

    async def main():
        tasks = [asyncio.ensure_future(proxy.generate(_req(f"r{i}", seed=i))) for i in range(8)]
        await asyncio.sleep(0.5)
        await proxy.sync_weights({}, 1, mode)  # type: ignore[arg-type]
        later = [asyncio.ensure_future(proxy.generate(_req(f"late{i}", seed=100 + i))) for i in range(8)]
        while proxy.stats()["version"] < 1:
            accepting.append(proxy.stats()["accepting"])
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks, *later)

    return run_virtual(main()), engines, accepting


def test_interrupt_mode_gives_samples_two_versions() -> None:
    done, engines, _ = _update_during("interrupt", 2)
    assert all(c.versions[0] == 0 and c.versions[-1] == 1 for c in done[:8])
    assert all(set(c.versions) == {1} for c in done[8:])
    assert all(e.stats()["weight_drain_s"] == 0 for e in engines)


@pytest.mark.parametrize("mode", ["defer", "staggered"])
def test_defer_and_staggered_keep_each_sample_on_one_version(mode) -> None:
    done, engines, accepting = _update_during(mode, 4)
    assert all(set(c.versions) == {0} for c in done[:8])
    assert all(e.stats()["version"] == 1 for e in engines)
    if mode == "staggered":  # one replica at a time: the others keep taking requests
        assert accepting and min(accepting) == 3
        assert Counter(len(set(c.versions)) for c in done) == Counter({1: 16})
    else:
        assert all(set(c.versions) == {1} for c in done[8:])


def test_real_engines_interrupt_and_removal_keep_per_token_versions_and_logprobs() -> None:
    """Two built-in torch replicas on a tiny Llama: weights change mid-generation (interrupt) and
    one replica is removed; every token's behaviour log-prob is its own version's."""
    import copy

    import torch

    from sluice.engines.hf_inference import HFInferenceEngine
    from tiny import tiny_llama

    torch.set_num_threads(1)
    models = {0: tiny_llama(0), 1: tiny_llama(1)}
    engines = [HFInferenceEngine(copy.deepcopy(models[0]), max_batch=4) for _ in range(2)]
    proxy = LLMProxy(engines)
    requests = [GenerationRequest(f"r{i}", (1 + i, 2, 3), SamplingParams(16), seed=i) for i in range(4)]

    async def main():
        tasks = [asyncio.ensure_future(proxy.generate(r)) for r in requests]
        for _ in range(4):
            await asyncio.sleep(0)
        new = {n: p.detach().clone() for n, p in models[1].named_parameters()}
        await proxy.sync_weights(new, 1, "interrupt")
        for _ in range(3):
            await asyncio.sleep(0)
        moved = await proxy.remove_replica(0)
        return moved, await asyncio.gather(*tasks)

    moved, done = asyncio.run(main())
    assert moved == 2 and proxy.stats()["rerouted"] == 2
    for c, r in zip(done, requests, strict=True):
        old_tokens = c.versions.count(0)
        assert c.finish_reason == "length" and len(c.token_ids) == 16 and 0 < old_tokens < 16
        assert c.versions == (0,) * old_tokens + (1,) * (16 - old_tokens)
        ids = torch.tensor([r.prompt_ids + c.token_ids])
        for version, model in models.items():
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1], -1)
            expected = logp.gather(1, torch.tensor(c.token_ids).unsqueeze(1)).squeeze(1)
            mine = torch.tensor([v == version for v in c.versions])
            torch.testing.assert_close(torch.tensor(c.logprobs)[mine], expected[mine], atol=1e-4, rtol=0)


def test_a_replica_of_its_own_is_driven_through_the_protocol() -> None:
    """Any ``Replica`` (coroutine verbs) is routed to as is, not wrapped as an engine: requests
    of one group share a replica, and a weight update reaches every replica with its mode."""
    from fakes import FakeReplica

    replicas = [FakeReplica(), FakeReplica()]
    proxy = LLMProxy(replicas, prompt_replication=False)

    async def main():
        group = [_req(f"g0-s{k}", affinity="g0", max_new=4, seed=k) for k in range(3)]
        done = await asyncio.gather(*(proxy.generate(r) for r in group))
        proxy.update_weights({}, 1, "defer")
        for _ in range(10):
            await asyncio.sleep(0)
        return done

    done = asyncio.run(main())
    assert [len(c.token_ids) for c in done] == [1, 2, 3]  # the fake's scripted lengths (seed % 4 + 1)
    served = [len(r.engine.requests) for r in replicas]
    assert sorted(served) == [0, 3]  # no prompt replication: the group stayed on one replica
    assert all(r.updates == [(1, "defer")] for r in replicas)
