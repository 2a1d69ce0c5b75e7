"""LLMProxy when a replica's process dies (a verb raises ``ReplicaLost``): its requests continue
on the other replicas, a replacement joins with the newest weights, and with no replica left and
none coming every request fails with ``ReplicaLost`` instead of waiting forever."""

from __future__ import annotations

import asyncio

import pytest

from fakes import FakeLengthPredictor, FakeReplica
from sluice.api import GenerationRequest, ReplicaLost, SamplingParams
from sluice.rollout.proxy import LLMProxy


def _req(rid: str, seed: int) -> GenerationRequest:
    return GenerationRequest(rid, (1, 2), SamplingParams(8), seed=seed)


async def _until(predicate) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_a_dead_replicas_requests_continue_elsewhere_and_a_replacement_joins_with_the_newest_weights() -> None:
    dying, steady = FakeReplica(hold=True), FakeReplica()
    spares: list[FakeReplica] = []

    async def replace() -> FakeReplica:
        spares.append(FakeReplica())
        return spares[-1]

    proxy = LLMProxy([dying, steady], replace=replace)

    async def main():
        await proxy.sync_weights({"w": 1}, 3, "interrupt")
        tasks = [asyncio.ensure_future(proxy.generate(_req(f"r{i}", seed=i))) for i in range(4)]
        await _until(lambda: dying.holding == 2)  # least outstanding tokens: two on each replica
        dying.kill()
        done = await asyncio.gather(*tasks)
        await _until(lambda: len(proxy.replica_ids) == 2)
        return done

    done = asyncio.run(main())
    assert all(c.finish_reason != "abort" and len(c.token_ids) > 0 for c in done)
    assert [c.versions[0] for c in done] == [3] * 4
    stats = proxy.stats()
    assert stats["replicas_lost"] == 1 and stats["replicas_added"] == 1 and stats["rerouted"] == 2
    assert spares[0].updates == [(3, "interrupt")] and proxy.replicas == [steady, spares[0]]


def test_replacements_are_bounded() -> None:
    replicas = [FakeReplica(hold=True)]

    async def replace() -> FakeReplica:
        replicas.append(FakeReplica(hold=True))
        return replicas[-1]

    proxy = LLMProxy(replicas[:1], replace=replace, replacements=2)

    async def main():
        task = asyncio.ensure_future(proxy.generate(_req("r", seed=1)))
        for killed in range(3):
            await _until(lambda k=killed: len(replicas) > k and replicas[k].holding == 1)
            replicas[killed].kill()
        with pytest.raises(ReplicaLost, match="every engine replica died"):
            await task

    asyncio.run(main())
    assert proxy.stats()["replicas_lost"] == 3 and proxy.stats()["replicas_added"] == 2


@pytest.mark.parametrize("longest_first", [False, True], ids=["routed", "longest-first"])
def test_with_no_replica_left_requests_fail_instead_of_waiting(longest_first) -> None:
    only = FakeReplica(hold=True)
    lpt = {"length_predictor": FakeLengthPredictor({}, default=4.0), "slots": 1} if longest_first else {}
    proxy = LLMProxy([only], **lpt)

    async def main():
        running = asyncio.ensure_future(proxy.generate(_req("running", seed=1)))
        await _until(lambda: only.holding == 1)
        waiting = asyncio.ensure_future(proxy.generate(_req("waiting", seed=2)))  # no free slot / replica yet
        await asyncio.sleep(0)
        only.kill()
        for task in (running, waiting):
            with pytest.raises(ReplicaLost):
                await task
        with pytest.raises(ReplicaLost):  # and every later request
            await proxy.generate(_req("late", seed=3))

    asyncio.run(main())
    assert proxy.stats()["replicas"] == 0


def test_a_replica_found_dead_by_a_weight_update_or_stats_is_dropped() -> None:
    dead, alive = FakeReplica(), FakeReplica()
    proxy = LLMProxy([dead, alive])
    dead.kill()

    async def main():
        await proxy.sync_weights({"w": 1}, 1, "interrupt")
        await _until(lambda: proxy.stats()["version"] == 1)
        return await proxy.engine_stats()

    assert asyncio.run(main())["version"] == 1
    assert proxy.replicas == [alive] and proxy.stats()["replicas_lost"] == 1


def test_a_ray_actor_that_died_is_a_lost_replica() -> None:
    from ray.exceptions import ActorDiedError

    from sluice.rollout.replicas import RayReplica

    class DeadHandle:  # what calls on a killed actor's handle give back: refs that raise
        def __getattr__(self, verb):
            async def ref():
                raise ActorDiedError()

            return type("Method", (), {"remote": staticmethod(lambda *args: ref())})

    replica = RayReplica(DeadHandle())
    with pytest.raises(ReplicaLost, match="ActorDiedError"):
        asyncio.run(replica.stats())
    with pytest.raises(ReplicaLost):
        asyncio.run(replica.generate(_req("r", seed=0)))


def test_a_replica_actor_silent_for_the_timeout_is_killed(monkeypatch) -> None:
    """``watch_replicas``: the replica that stops answering its heartbeat is killed (the proxy then
    meets its death and replaces it); the one that answers is left alone."""
    import ray

    from sluice.rollout import replicas as module

    class Handle:
        def __init__(self, answers: bool) -> None:
            self.answers = answers
            self.heartbeat = self

        def options(self, **_):
            return self

        def remote(self):
            async def beat():
                if not self.answers:
                    await asyncio.Event().wait()  # stopped: never answers
                return 1.0

            return beat()

    stopped, working = Handle(False), Handle(True)
    killed: list[Handle] = []
    monkeypatch.setattr(ray, "kill", killed.append)
    counts: dict[str, float] = {}
    replicas = [module.RayReplica(stopped), module.RayReplica(working)]

    async def main():
        watch = asyncio.ensure_future(module.watch_replicas(lambda: replicas, 0.2, counts))
        await asyncio.sleep(0.5)
        watch.cancel()

    asyncio.run(main())
    assert killed and set(killed) == {stopped} and counts["replicas_silent"] >= 1


def test_the_proxy_reports_the_median_wall_time_of_a_request() -> None:
    """``request_s_median`` (one generation turn's wall time): what ``sluice bench e2e`` sets a
    waiting workload's μ to."""
    held = FakeReplica(hold=True)
    proxy = LLMProxy([held])

    async def main():
        tasks = [asyncio.ensure_future(proxy.generate(_req(f"r{i}", seed=i))) for i in range(3)]
        await _until(lambda: held.holding == 3)
        await asyncio.sleep(0.05)
        held.release()
        await asyncio.gather(*tasks)

    assert proxy.stats()["request_s_median"] == 0.0
    asyncio.run(main())
    assert proxy.stats()["request_s_median"] >= 0.05
