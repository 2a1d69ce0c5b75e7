"""TransferQueue semantics on the Ray backend: the shared suites of ``tests/unit/test_queue.py`` and
``tests/unit/test_queue_lifecycle.py`` against ``RayQueue``, plus producers and consumers in other
processes and on asyncio, and a DP group whose ranks share one fetch over torch.distributed."""

from __future__ import annotations

import asyncio
import random

import pytest
import ray

from sluice.api import Partition, QueueClient
from sluice.queue import AsyncRayQueue, QueueIterableDataset, RayQueue
from unit import test_queue as shared
from unit import test_queue_lifecycle as lifecycle

pytestmark = pytest.mark.integration


@pytest.fixture
def make_queue(ray_cluster):
    made: list[RayQueue] = []

    def make(num_units: int = 1, free_consumed: bool = False) -> QueueClient:
        made.append(RayQueue.create(num_storage_units=num_units, free_consumed=free_consumed))
        return made[-1]

    yield make
    for q in made:
        q.shutdown()


test_readiness_across_puts = shared.test_readiness_across_puts
test_exactly_once_and_independent_tasks = shared.test_exactly_once_and_independent_tasks
test_late_registration_sees_existing_rows = shared.test_late_registration_sees_existing_rows
test_policies = shared.test_policies
test_indices_restriction_and_timeout = shared.test_indices_restriction_and_timeout
test_waiting_get_is_woken_by_writes_and_close = shared.test_waiting_get_is_woken_by_writes_and_close
test_variable_length_roundtrip_multi_unit = shared.test_variable_length_roundtrip_multi_unit
test_neighbouring_rows_share_a_unit = shared.test_neighbouring_rows_share_a_unit
test_snapshot_restore_roundtrip = shared.test_snapshot_restore_roundtrip
test_clear_frees_rows_consumed_by_every_task = shared.test_clear_frees_rows_consumed_by_every_task
test_partition_tells_not_yet_from_done = lifecycle.test_partition_tells_not_yet_from_done
test_shards_redistribute_dp2_to_dp4 = lifecycle.test_shards_redistribute_dp2_to_dp4
test_partition_reaches_a_task_that_reads_only_a_later_column = (
    lifecycle.test_partition_reaches_a_task_that_reads_only_a_later_column
)
test_token_balanced_policy_evens_micro_batches = lifecycle.test_token_balanced_policy_evens_micro_batches
test_free_consumed_keeps_memory_bounded = lifecycle.test_free_consumed_keeps_memory_bounded
test_restore_mid_stream_neither_loses_nor_repeats = lifecycle.test_restore_mid_stream_neither_loses_nor_repeats


def test_a_put_notifies_only_the_tasks_that_read_its_columns(make_queue) -> None:
    """Ten idle tasks cost a partitioned put nothing: only the reading task's controller is called."""
    q = make_queue(2)
    q.register_task("train", ["x"])
    for k in range(10):
        q.register_task(f"idle{k}", ["other"])
    before = q.stats()["tasks"]
    q.put(list(range(60, 68)), {"x": [[i] for i in range(8)]}, partition=Partition(0, 8))  # 2 blocks
    after = q.stats()["tasks"]
    assert after["train"]["notifications"] == before["train"]["notifications"] + 2  # one per unit
    assert all(after[t]["notifications"] == before[t]["notifications"] for t in after if t != "train")
    assert q.get("train", ["x"], 8, partition=0, timeout=5).done


def test_producers_and_consumers_in_ray_tasks(make_queue) -> None:
    """Producer and consumer Ray tasks get the pickled client; every row reaches each task once."""
    q = make_queue(2)
    q.register_task("train", ["tokens", "logp"])
    q.register_task("audit", ["tokens"])

    def _tokens(i: int) -> list[int]:
        return [random.Random(i).randrange(50_000) for _ in range(i % 97)]

    @ray.remote(num_cpus=0)
    def produce(q: RayQueue, rows: list[int], seed: int) -> None:
        import time

        rng = random.Random(seed)
        while rows:
            k = rng.randint(1, 9)
            chunk, rows = rows[:k], rows[k:]
            q.put(chunk, {"tokens": [_tokens(i) for i in chunk]})
            time.sleep(rng.random() * 0.005)
            q.put(chunk, {"logp": [[-1.0] * len(_tokens(i)) for i in chunk]})

    @ray.remote(num_cpus=0)
    def consume(q: RayQueue, task: str, seed: int) -> list[tuple[int, list[int]]]:
        rng = random.Random(seed)
        out: list[tuple[int, list[int]]] = []
        while batch := q.get(task, ["tokens"], rng.randint(1, 8), min_size=1):
            out.extend(zip(batch.indices, batch.columns["tokens"], strict=True))
        return out

    rows = list(range(160))
    consumers = [consume.remote(q, "train", s) for s in range(2)]
    ray.get([produce.remote(q, rows[p::2], p) for p in range(2)])
    q.close()
    results = ray.get(consumers, timeout=60)
    audit = q.get("audit", ["tokens"], 240, timeout=0)
    for got in (results[0] + results[1], list(zip(audit.indices, audit.columns["tokens"], strict=True))):
        indices = [i for i, _ in got]
        assert len(indices) == len(set(indices)) and sorted(indices) == rows
        assert all(tokens == _tokens(i) for i, tokens in got)


def test_async_client_producers_and_consumers_and_dataset(make_queue) -> None:
    q = make_queue()
    aq = AsyncRayQueue(q)

    async def main() -> list[int]:
        await aq.register_task("t", ["x"])

        async def produce(p: int) -> None:
            for i in range(p, 60, 3):
                await aq.put([i], {"x": [list(range(i))]})
                await asyncio.sleep(random.random() * 0.002)

        async def consume() -> list[int]:
            seen = []
            while batch := await aq.get("t", ["x"], 4, min_size=1, timeout=2.0):
                assert batch.columns["x"] == [list(range(i)) for i in batch.indices]
                seen.extend(batch.indices)
            return seen

        consumers = [asyncio.create_task(consume()) for _ in range(3)]
        await asyncio.gather(*(produce(p) for p in range(3)))
        await aq.close()
        return [i for seen in await asyncio.gather(*consumers) for i in seen]

    got = asyncio.run(main())
    assert len(got) == len(set(got)) and sorted(got) == list(range(60))
    q.put(list(range(60, 70)), {"x": [[i] for i in range(60, 70)]})
    assert [len(b) for b in QueueIterableDataset(q, "t", ["x"], batch_size=4)] == [4, 4, 2]  # closed: no waiting


@ray.remote(num_cpus=0)
class _Rank:
    """One rank of a DP group: a gloo process group of its own, reading through ``DPGroupReader``."""

    def __init__(self, rank: int, size: int, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)

    def read(self, q: RayQueue | None, steps: int) -> list[tuple[tuple[int, ...], list[list[int]]]]:
        from dp_group import DPGroupReader, TorchGroupBroadcast

        reader = DPGroupReader(q, TorchGroupBroadcast())
        out = []
        for _ in range(steps):
            batch = reader.get("train", ["ids"], 4, timeout=10)
            out.append((batch.indices, list(batch.columns["ids"])))
        return out


def test_dp_group_broadcast_over_torch_distributed(make_queue) -> None:
    import socket

    q = make_queue(2)
    q.register_task("train", ["ids"])
    q.put(list(range(12)), {"ids": [[i] * (i % 5) for i in range(12)]})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [_Rank.remote(r, 2, port) for r in range(2)]
    got = ray.get([rank.read.remote(q if r == 0 else None, 3) for r, rank in enumerate(ranks)], timeout=60)
    assert got[0] == got[1]  # rank 1 never talked to the queue, yet holds the same rows
    assert sorted(i for indices, _ in got[0] for i in indices) == list(range(12))
    assert all(cols == [[i] * (i % 5) for i in indices] for indices, cols in got[1])
    assert q.stats()["tasks"]["train"]["consumed"] == 12
    for rank in ranks:
        ray.kill(rank)


def test_object_store_path_and_remote_errors(ray_cluster) -> None:
    """Without shared memory (as across nodes) every call and byte goes through Ray; errors still surface."""
    q = RayQueue.create(num_storage_units=2, shared_memory=False)
    try:
        shared.test_variable_length_roundtrip_multi_unit(lambda num_units=2: q)
    finally:
        q.shutdown()
    q = RayQueue.create(num_storage_units=2)
    try:
        q.register_task("t", ["x"])
        with pytest.raises(ValueError, match="did not register"):
            q.get("t", ["y"], 1, timeout=0)  # raised in the controller, over the direct socket
        big = [list(range(20_000)), list(range(5))]  # one unit's share above the arena threshold
        q.put([0, 1], {"x": big})
        assert q.get("t", ["x"], 2).columns["x"] == big
    finally:
        q.shutdown()


@pytest.mark.faults  # it stops a process
def test_shutdown_waits_once_for_a_stopped_unit_and_kills_every_actor(ray_cluster) -> None:
    """Unit 0 SIGSTOPped (as the run's watchdog finds it, ``tests/faults``): ``shutdown`` waits
    once for its answer (10 s), not again for its ``close_transport``, and kills every actor,
    the stopped one included."""
    import os
    import signal
    import time

    q = RayQueue.create(num_storage_units=2)
    q.register_task("t", ["x"])
    actors = [*q.units, *q.controllers().values()]
    pids = [ray.get(a.__ray_call__.remote(lambda _: os.getpid())) for a in actors]
    os.kill(pids[0], signal.SIGSTOP)
    started = time.monotonic()
    q.shutdown()
    took = time.monotonic() - started
    assert took < 17.0, f"shutdown took {took:.1f} s: a stopped unit was waited for twice (10 s each)"

    _assert_gone(pids)


def _assert_gone(pids: list[int]) -> None:
    import time

    def running(pid: int) -> bool:  # a zombie (exited, not yet reaped by its raylet) is not
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 30  # ray.kill returns before the processes have exited
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"queue actors outlived shutdown: {alive}"


@pytest.mark.faults  # it stops a process
@pytest.mark.parametrize("stopped", ["unit", "controller"])
def test_shutdown_waits_for_no_actor_the_watchdog_found_silent(ray_cluster, stopped: str) -> None:
    """Unit 0 or a controller SIGSTOPped and named in ``silent`` (what ``RayPipeline.close`` passes:
    the actors its heartbeats found silent, ``runtime/supervision.py: Answers``): ``shutdown``
    waits for neither (each wait ran to its 10 s timeout, once per stopped actor of a recovery
    chain) and kills every actor, the stopped one included."""
    import os
    import signal
    import time

    q = RayQueue.create(num_storage_units=2)
    q.register_task("t", ["x"])
    actors = [*q.units, *q.controllers().values()]
    pids = [ray.get(a.__ray_call__.remote(lambda _: os.getpid())) for a in actors]
    index = 0 if stopped == "unit" else 2
    os.kill(pids[index], signal.SIGSTOP)
    started = time.monotonic()
    q.shutdown(silent={actors[index]._actor_id.hex()})
    took = time.monotonic() - started
    assert took < 5.0, f"shutdown took {took:.1f} s: it waited for a {stopped} found silent"
    _assert_gone(pids)
