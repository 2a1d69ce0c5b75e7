"""The multi-controller DAG runtime on real Ray: workers move their own rows through the queue
(0 sample bytes through the driver, while the single-controller variant carries every batch),
redistribution between nodes of different data-parallel sizes, distributed prompt loading with
one cursor per shard, metrics aggregated at rank 0, and the staleness bound with 2 rollout workers."""

from __future__ import annotations

import pytest
from distflow.data_nodes import SYNTHETIC_GENERATE, TOKEN_CHECKSUM, IndexPrompts
from distflow.runtime import MultiControllerRun, SingleControllerRun
from distflow.worker import RuntimeSettings

from sluice.dag import compile_dag, parse_dag

pytestmark = pytest.mark.integration


def _dag(gen: int, score: int, tokens: int) -> dict:
    return {
        "name": "data_path",
        "nodes": [
            {"id": "gen", "role": "rollout", "type": "generate", "reads": ["prompt"],
             "writes": ["response_ids", "reward"], "function": SYNTHETIC_GENERATE, "parallel": gen,
             "options": {"group_size": 4, "tokens": tokens}, "resources": {"pool": "gen"}},
            {"id": "score", "role": "reward", "type": "compute", "reads": ["response_ids"], "writes": ["checksum"],
             "function": TOKEN_CHECKSUM, "parallel": score, "resources": {"pool": "score"}},
            {"id": "train", "role": "actor", "type": "compute", "reads": ["reward", "checksum"],
             "writes": ["total"], "function": "weighted_sum", "parallel": 1, "resources": {"pool": "score"}},
        ],
    }  # fmt: skip


def _run(kind, plan, settings):
    run = kind(plan, settings)
    try:
        run.ready()  # every actor up, one warm-up row per node in partitions no step reads
        result = run.run()
        rows = {}
        if (
            kind is MultiControllerRun
        ):  # read back what the workers wrote (the test's process, not the driver's counter)
            run.queue.register_task("check", ["checksum", "total"])
            batch = run.queue.get("check", ["checksum", "total"], 10_000, timeout=5)
            rows = dict(
                zip(batch.indices, zip(batch.columns["checksum"], batch.columns["total"], strict=True), strict=True)
            )
            seen = run.transport.get([run.transport.call(a.rows_seen) for a in run.workers["score"]])
            return result, rows, seen
        return result, rows, []
    finally:
        run.close()


def test_multi_controller_moves_no_sample_bytes_through_the_driver(ray_cluster):
    steps, groups = 2, 4  # 16 rows of 2,000 tokens per step
    settings = RuntimeSettings(groups, 4, steps, IndexPrompts(64), max_staleness=1)
    plan = compile_dag(parse_dag(_dag(gen=2, score=3, tokens=2000)), "colocated")
    multi, rows, seen = _run(MultiControllerRun, plan, settings)
    # the positive control carries the same batches through its driver on one worker per node:
    # its bytes do not depend on how many workers share a node, and each worker is a Ray actor
    one_each = compile_dag(parse_dag(_dag(gen=1, score=1, tokens=2000)), "colocated")
    single, _, _ = _run(SingleControllerRun, one_each, settings)

    batch_bytes = 16 * 2000 * 4  # one step's response_ids (int32)
    assert multi.driver.sample == 0
    assert multi.driver.total < 200_000  # control messages only: plans, handles, metrics
    assert single.driver.sample >= steps * batch_bytes  # the positive control: every batch, both ways
    # every row was generated once, scored once and combined (redistribution 2 -> 3 -> 1 workers)
    assert sorted(rows) == list(range(steps * 16))
    assert all(total == pytest.approx(checksum + (r % 2)) for r, (checksum, total) in rows.items())
    score_rows = [r for rank in seen for (_, r, _) in rank]
    assert sorted(score_rows) == sorted([*rows, *rows])  # score (3 ranks) and train (rank 0) each read every row
    per_rank = [sum(1 for s, _, _ in rank if s == 0) for rank in seen]
    assert sorted([per_rank[0] - 16, *per_rank[1:]]) == [5, 5, 6]  # 16 rows split 6/5/5; rank 0 also combines
    # metrics reached rank 0 of each group; prompts came from each generator's own shard
    assert multi.metrics["score"][steps - 1]["total_mean"] > 0
    assert [c["rank"] for c in multi.cursors] == [0, 1] and sum(c["position"] for c in multi.cursors) == steps * groups


def test_the_staleness_bound_holds_with_two_rollout_workers(ray_cluster):
    steps, groups = 4, 4
    for eta in (1,):  # η = 0 and the credit rule in general: tests/unit/test_dag_runtime_parts.py
        settings = RuntimeSettings(groups, 4, steps, IndexPrompts(40), max_staleness=eta, grants_per_call=1)
        plan = compile_dag(parse_dag(_dag(gen=2, score=2, tokens=64)), "colocated")
        result, rows, seen = _run(MultiControllerRun, plan, settings)
        trained = [t for rank in seen for t in rank]
        staleness = [step - version for step, _, version in trained]
        assert len(rows) == steps * groups * 4
        assert max(staleness) == eta and min(staleness) == 0  # η = 1: generation ran one step ahead
        assert result.gate["max_lead"] <= eta and result.gate["version"] == steps
        assert all(c["position"] + c["epoch"] * 20 > 0 for c in result.cursors)  # both rollout workers generated


def test_the_gate_answers_same_node_workers_over_its_socket(ray_cluster):
    import pickle
    import threading

    import ray
    from distflow.gate import ServedGate
    from distflow.peer import Peer

    gate = ray.remote(ServedGate).options(num_cpus=0, max_concurrency=8).remote(2, 0, 2, 1)
    try:
        peer = Peer(gate)
        assert peer.call("acquire", 5, 10.0) == [(0, 0), (1, 0)]
        assert peer._address  # this process shares the gate's node: the call went over the socket
        got: list = []
        other = Peer(gate)  # a second caller waits on its own connection and thread
        waiter = threading.Thread(target=lambda: got.extend(other.call("acquire", 5, 10.0)))
        waiter.start()
        assert peer.call("step_done", 0) == 1
        waiter.join(10)
        assert got == [(2, 1), (3, 1)] and peer.call("stats")["version"] == 1
        assert pickle.loads(pickle.dumps(peer))._address is None  # another process resolves its own way
    finally:
        ray.get(gate.close_transport.remote())
        ray.kill(gate)


def test_ready_maps_every_units_arena_and_every_outbox(ray_cluster):
    """Rows live in blocks dealt over the units: the warm-up must touch every unit, or the first
    timed steps pay for mapping arenas (each worker's outbox in every unit, every unit's arena in
    every consuming worker)."""
    import ray

    def _mapped(_actor) -> set[str]:  # run inside an actor (a nested function travels by value)
        from sluice.queue import shm

        return set(shm._attached)

    def _outbox_name(_actor) -> str:
        from sluice.queue import shm

        return shm.outbox().name

    settings = RuntimeSettings(4, 4, 1, IndexPrompts(8))
    plan = compile_dag(parse_dag(_dag(gen=2, score=2, tokens=64)), "disaggregated")
    run = MultiControllerRun(plan, settings, storage_units=3)
    try:
        run.ready()
        units = run.queue.units
        arenas = ray.get([u.__ray_call__.remote(lambda self: self._arena.name) for u in units])
        mapped_by_units = ray.get([u.__ray_call__.remote(_mapped) for u in units])
        workers = [a for actors in run.workers.values() for a in actors]
        outboxes = ray.get([a.__ray_call__.remote(_outbox_name) for a in workers])
        readers = run.workers["score"] + run.workers["train"]
        mapped_by_readers = ray.get([a.__ray_call__.remote(_mapped) for a in readers])
    finally:
        run.close()
    assert all(set(outboxes) <= mapped for mapped in mapped_by_units)
    assert all(set(arenas) <= mapped for mapped in mapped_by_readers)


def test_get_views_reads_a_units_arena_in_place_until_the_block_ends(ray_cluster):
    import numpy as np
    import ray

    from sluice.api import Partition
    from sluice.queue import RayQueue, shm
    from sluice.queue.packed import PackedColumn, offsets_of

    queue = RayQueue.create(1, tasks={"t": ["x"]})
    try:
        values = np.arange(2 * 65_536, dtype=np.int32)  # two rows of 256 KiB: the shared-memory path
        queue.put([0, 1], {"x": PackedColumn(values, offsets_of([65_536, 65_536]), "list")}, partition=Partition(0, 2))
        unit = queue.units[0]
        arena = ray.get(unit.__ray_call__.remote(lambda self: self._arena.name))
        with queue.get_views("t", ["x"], 2, partition=0, timeout=10) as batch:
            column = batch.columns["x"]
            assert np.shares_memory(column.values, shm.attach(arena))  # no copy out of the unit's arena
            assert np.array_equal(column.values, values)
            assert ray.get(unit.__ray_call__.remote(lambda self: sum(not e[3] for e in self._arena._live))) == 1
        assert ray.get(unit.__ray_call__.remote(lambda self: sum(not e[3] for e in self._arena._live))) == 0  # released
    finally:
        queue.shutdown()
