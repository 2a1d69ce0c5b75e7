"""LLMProxy over a Ray actor replica and an in-process one (real time, scaled SimEngines): the
actor's in-flight requests move to the local replica when it is removed; weights reach both."""

from __future__ import annotations

import asyncio

from sluice.api import GenerationRequest, SamplingParams
from sluice.rollout.proxy import LLMProxy
from sluice.rollout.replicas import RayReplica
from sluice.sim import LengthModel, SimEngine, SimEngineConfig

CONFIG = SimEngineConfig(decode_s=0.01, load_s=0.1, time_scale=0.05, lengths=LengthModel(2000, 0.0, 0.2))
"""Requests of ≈ 1 s of wall time each: a driver stalled by a loaded machine for a few tenths of a
second still finds them running when it removes the replica."""


def test_ray_replica_weights_and_removal(ray_cluster) -> None:
    actor = ray_cluster.remote(SimEngine).remote(CONFIG)
    local = SimEngine(CONFIG)
    proxy = LLMProxy([actor, local], poll_s=0.01)
    assert isinstance(proxy._states[0].replica, RayReplica)
    requests = [GenerationRequest(f"r{i}", (1, 2), SamplingParams(8000), seed=i) for i in range(6)]

    async def main():
        await proxy.sync_weights({"w": 1.0}, 1, "interrupt")
        tasks = [asyncio.ensure_future(proxy.generate(r)) for r in requests]
        await asyncio.sleep(0.05)
        moved = await proxy.remove_replica(0)
        done = await asyncio.gather(*tasks)
        remote = await actor.stats.remote()
        return moved, done, remote

    moved, done, remote = asyncio.run(main())
    assert moved == 3 and proxy.stats()["rerouted"] == 3 and remote["version"] == 1
    assert all(c.finish_reason == "stop" and set(c.versions) == {1} for c in done)
    assert sum(len(c.token_ids) for c in done) == remote["generated_tokens"] + local.stats()["generated_tokens"]


def test_a_supervised_actor_gives_its_nodes_address_as_ray_knows_it(ray_cluster) -> None:
    """Rendezvous addresses (the trainer ranks') come from Ray's node list, not the hostname."""
    from sluice.runtime.ray_supervision import supervised
    from sluice.trainer.rendezvous import free_tcp_address

    class Worker:
        def node(self) -> str:
            return ray_cluster.get_runtime_context().get_node_id()

    actor = supervised(Worker).remote()
    ip, node = ray_cluster.get([actor.node_ip.remote(), actor.node.remote()])
    assert ip == next(n["NodeManagerAddress"] for n in ray_cluster.nodes() if n["NodeID"] == node)
    assert free_tcp_address(ip).startswith(f"tcp://{ip}:")
    ray_cluster.kill(actor)
