"""TransferQueue partitions, shards (DistFlow redistribution), token balancing, freeing, restore, DP groups.

Tests that take ``make_queue`` are backend-independent: ``tests/integration/test_queue_ray.py``
runs the same functions against ``RayQueue``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_group import DPGroupReader, ThreadGroupBroadcast
from sluice.api import Partition, QueueClient, RowMeta, Shard
from sluice.queue import LocalQueue
from sluice.queue.lifecycle import FreedRows
from sluice.queue.policies import token_balanced_policy
from sluice.queue.shards import balance_shards

MakeQueue = Callable[..., QueueClient]


@pytest.fixture(params=[1, 2], ids=["1unit", "2units"])
def make_queue(request) -> MakeQueue:
    def make(num_units: int = request.param, free_consumed: bool = False) -> QueueClient:
        return LocalQueue(num_storage_units=num_units, free_consumed=free_consumed)

    return make


def rows_meta(indices: list[int], tokens: dict[int, int], version: int = 0) -> list[RowMeta]:
    return [RowMeta(index=i, group_id=i, version=version, num_tokens=tokens[i]) for i in indices]


def run_threads(*targets: Callable[[], None]) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


# ---------------------------------------------------------------- shared semantics (both backends)


def test_partition_tells_not_yet_from_done(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("t", ["x"])
    early = q.get("t", ["x"], 10, partition=7, timeout=0)
    assert len(early) == 0 and not early.done  # nothing declared yet: "not yet"
    q.put([0, 1, 2], {"x": [[0], [1], [2]]}, partition=Partition(7, 5))
    q.put([50], {"x": [[50]]})  # not in the partition
    first = q.get("t", ["x"], 10, partition=7, min_size=1, timeout=0)
    assert first.indices == (0, 1, 2) and not first.done
    q.put([3, 4], {"x": [[3], [4]]}, partition=Partition(7, 5))
    last = q.get("t", ["x"], 10, partition=7)  # owes only 2 rows: no timeout needed
    assert last.indices == (3, 4) and last.done and [m.partition for m in last.meta] == [7, 7]
    after = q.get("t", ["x"], 10, partition=7)  # returns at once: "done", not "not yet"
    assert len(after) == 0 and after.done
    assert q.get("t", ["x"], 10, timeout=0).indices == (50,)
    with pytest.raises(ValueError, match="declared with 6"):
        q.put([5], {"x": [[5]]}, partition=Partition(7, 6))


def test_partition_reaches_a_task_that_reads_only_a_later_column(make_queue: MakeQueue) -> None:
    """A task whose columns the partitioned put did not write learns the partition with its rows."""
    q = make_queue()
    q.register_task("score", ["y"])
    q.put([0, 1], {"x": [[0], [1]]}, partition=Partition(3, 2))
    early = q.get("score", ["y"], 2, partition=3, timeout=0)
    assert len(early) == 0 and not early.done
    q.put([0, 1], {"y": [[10], [11]]})  # no partition argument: the rows carry it
    batch = q.get("score", ["y"], 2, partition=3, timeout=5)
    assert batch.indices == (0, 1) and batch.done


def test_shards_redistribute_dp2_to_dp4(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("train", ["ids"])
    rng = random.Random(0)
    tokens = {i: rng.randint(1, 100) for i in range(64)}
    part = Partition(3, 64)
    assert len(q.get("train", ["ids"], 64, partition=3, shard=Shard(0, 4), timeout=0)) == 0

    def produce(rank: int) -> Callable[[], None]:  # stage A, DP 2: rank k writes rows k::2 in chunks
        def run() -> None:
            mine = list(range(rank, 64, 2))
            for c in range(0, 32, 8):
                chunk = mine[c : c + 8]
                q.put(chunk, {"ids": [[i] * tokens[i] for i in chunk]}, rows_meta(chunk, tokens), partition=part)

        return run

    got: dict[int, list[int]] = {}

    def consume(rank: int) -> Callable[[], None]:  # stage B, DP 4: waits for the whole partition
        def run() -> None:
            batch = q.get("train", ["ids"], 64, partition=3, shard=Shard(rank, 4), timeout=30)
            assert batch.done and batch.columns["ids"] == [[i] * tokens[i] for i in batch.indices]
            got[rank] = list(batch.indices)

        return run

    run_threads(*(consume(r) for r in range(4)), *(produce(r) for r in range(2)))
    assert [len(got[r]) for r in range(4)] == [16, 16, 16, 16]
    assert sorted(i for r in range(4) for i in got[r]) == list(range(64))
    loads = [sum(tokens[i] for i in got[r]) for r in range(4)]
    assert max(loads) - min(loads) <= max(tokens.values())


def test_token_balanced_policy_evens_micro_batches(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("t", ["x"])
    rng = random.Random(1)
    tokens = {i: (1000 if i % 8 < 2 else 10) + rng.randint(0, 9) for i in range(64)}  # long rows cluster
    q.put(list(range(64)), {"x": [[1] * tokens[i] for i in range(64)]}, rows_meta(list(range(64)), tokens))
    balanced = [q.get("t", ["x"], 8, policy="token_balanced", timeout=0) for _ in range(4)]
    q2 = make_queue()
    q2.register_task("t", ["x"])
    q2.put(list(range(64)), {"x": [[1] * tokens[i] for i in range(64)]}, rows_meta(list(range(64)), tokens))
    plain = [q2.get("t", ["x"], 8, timeout=0) for _ in range(4)]

    def spread(batches: list) -> int:
        sums = [sum(m.num_tokens for m in b.meta) for b in batches]
        return max(sums) - min(sums)

    assert all(len(b) == 8 for b in balanced) and balanced[0].indices[0] == 0  # oldest row first
    assert spread(balanced) < spread(plain) or spread(plain) == 0
    seen = [i for b in balanced for i in b.indices]
    assert len(seen) == len(set(seen)) == 32


def test_free_consumed_keeps_memory_bounded(make_queue: MakeQueue) -> None:
    q = make_queue(free_consumed=True)
    q.register_task("a", ["ids"])
    q.register_task("b", ["ids", "score"])
    chunk, total, peak = 64, 10_240, 0
    for start in range(0, total, chunk):
        rows = list(range(start, start + chunk))
        q.put(rows, {"ids": [[i % 997] * (1 + i % 50) for i in rows]})
        got = q.get("a", ["ids"], chunk, timeout=5)
        assert got.indices == tuple(rows) and got.columns["ids"][-1] == [rows[-1] % 997] * (1 + rows[-1] % 50)
        q.put(rows, {"score": [float(i) for i in rows]})  # task a's output; b needs it
        if start % (16 * chunk) == 0:
            peak = max(peak, q.stats()["rows"])
        assert q.get("b", ["ids", "score"], chunk, timeout=5).indices == tuple(rows)
    stats = q.stats()
    assert peak <= chunk and stats["rows"] == 0
    assert all(u["packed_bytes"] == 0 and u["freed_ranges"] <= 1 for u in stats["units"])
    assert all(t["consumed"] == 0 for t in stats["tasks"].values())  # controllers forgot freed rows
    q.put([5], {"score": [1.0]})  # a late write to a freed row is ignored
    assert q.stats()["rows"] == 0 and sum(u["late_writes"] for u in q.stats()["units"]) == 1


def test_restore_mid_stream_neither_loses_nor_repeats(make_queue: MakeQueue) -> None:
    q = make_queue(free_consumed=True)
    q.register_task("train", ["ids"])
    q.register_task("ref", ["ids"])
    part = Partition(0, 40)
    q.put(list(range(30)), {"ids": [[i] * (i % 7) for i in range(30)]}, partition=part)
    seen = {"train": list(q.get("train", ["ids"], 12, partition=0).indices)}
    seen["ref"] = list(q.get("ref", ["ids"], 20, partition=0).indices)
    state = q.snapshot()

    r = make_queue(num_units=3, free_consumed=True)
    r.restore(state)
    r.put(list(range(30, 40)), {"ids": [[i] * (i % 7) for i in range(30, 40)]}, partition=part)
    for task in ("train", "ref"):
        rest = r.get(task, ["ids"], 40, partition=0)
        assert rest.done and rest.columns["ids"] == [[i] * (i % 7) for i in rest.indices]
        seen[task] += rest.indices
        assert sorted(seen[task]) == list(range(40))  # every row exactly once per task
    assert r.stats()["rows"] == 0  # consumed by both tasks: freed, before and after the restore


# ---------------------------------------------------------------- in-process only


def test_dp_group_ranks_get_the_same_rows_from_one_fetch() -> None:
    q = LocalQueue(num_storage_units=2)
    q.register_task("train", ["ids"])
    q.put(list(range(48)), {"ids": [[i] * 3 for i in range(48)]})
    got: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    groups = {g: ThreadGroupBroadcast.group(3) for g in range(2)}  # 2 DP groups × 3 ranks

    def rank(g: int, r: int) -> Callable[[], None]:
        def run() -> None:
            reader = DPGroupReader(q if r == 0 else None, groups[g][r])
            got[g, r] = [reader.get("train", ["ids"], 4, timeout=5).indices for _ in range(6)]

        return run

    run_threads(*(rank(g, r) for g in range(2) for r in range(3)))
    for g in range(2):
        assert got[g, 0] == got[g, 1] == got[g, 2]
    rows = [i for g in range(2) for b in got[g, 0] for i in b]
    assert sorted(rows) == list(range(48))  # the groups got disjoint rows, each fetched once
    assert q.stats()["tasks"]["train"]["consumed"] == 48


@settings(max_examples=40, deadline=None)
@given(
    a=st.integers(1, 4),
    b=st.integers(1, 6),
    tokens=st.lists(st.integers(0, 500), max_size=48),
)
def test_redistribution_property(a: int, b: int, tokens: list[int]) -> None:
    """Rows written by a DP-``a`` stage reach a DP-``b`` stage in balanced, disjoint, complete shards."""
    q = LocalQueue(num_storage_units=2)
    q.register_task("next", ["x"])
    n, by_row = len(tokens), dict(enumerate(tokens))
    for rank in range(a):
        mine = list(range(rank, n, a))
        q.put(mine, {"x": [[i] for i in mine]}, rows_meta(mine, by_row), partition=Partition(1, n))
    shards = [q.get("next", ["x"], max(n, 1), partition=1, shard=Shard(r, b)) for r in range(b)]
    sizes = [len(s) for s in shards]
    assert all(s.done for s in shards) and sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert sorted(i for s in shards for i in s.indices) == list(range(n))
    loads = [sum(by_row[i] for i in s.indices) for s in shards]
    assert not tokens or max(loads) - min(loads) <= max(tokens)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 1000), max_size=60), k=st.integers(1, 7))
def test_balance_shards_property(tokens: list[int], k: int) -> None:
    shards = balance_shards(tokens, k)
    assert len(shards) == k and sorted(i for s in shards for i in s) == list(range(len(tokens)))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    loads = [sum(tokens[i] for i in s) for s in shards]
    assert not tokens or max(loads) - min(loads) <= max(tokens)


def test_token_balanced_policy_includes_the_oldest_and_respects_size() -> None:
    metas = [RowMeta(i, i, version=1 if i < 20 else 0, num_tokens=(i * 37) % 101) for i in range(40)]
    chosen = token_balanced_policy(metas, 5)
    assert len(chosen) == len(set(chosen)) == 5 and 20 in chosen  # row 20 is the oldest (version 0)
    assert token_balanced_policy(metas[:3], 5) == [0, 1, 2]


def test_freed_rows_merge_into_ranges() -> None:
    freed = FreedRows(num_units=2)
    freed.add(range(1, 200, 2))  # every row of unit 1
    freed.add([401, 403])
    assert freed.num_ranges == 2 and 199 in freed and 201 not in freed and 403 in freed and 200 not in freed
    assert len(freed) == 102 and freed.indices()[:3] == [1, 3, 5]
    with pytest.raises(ValueError, match="several units"):
        freed.add([2])


def test_freed_rows_of_a_block_placed_unit() -> None:
    """Unit 1 of 3 with blocks of 4 holds rows 4..7, 16..19, ...: one range, exact membership."""
    freed = FreedRows(num_units=3, block=4)
    rows = [i for i in range(0, 120) if (i // 4) % 3 == 1]
    freed.add(rows)
    assert freed.num_ranges == 1 and freed.indices() == rows
    assert all((i in freed) == (i in set(rows)) for i in range(130))
    with pytest.raises(ValueError, match="several units"):
        freed.add([0])


def test_docs_custom_task_example_runs() -> None:
    """The example in docs/queue.md is real code: run it."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "queue.md").read_text()
    section = text[text.index("## A custom task") :]
    start = section.index("```python") + len("```python")
    code = section[start : section.index("```\n", start)]
    scope: dict[str, object] = {}
    exec(compile(code, "docs/queue.md", "exec"), scope)
    train = scope["train"]
    assert sorted(train.indices) == [0, 1, 2, 3] and not train.done  # type: ignore[attr-defined]
    by_row = dict(zip(train.indices, train.columns["score"], strict=True))  # type: ignore[attr-defined]
    assert by_row == {0: 3.0, 1: 2.0, 2: 1.0, 3: 4.0}  # the custom task's column reached the trainer


def test_shm_arena_ring_never_overlaps_live_slots() -> None:
    from sluice.queue import shm

    arena = shm.Arena(capacity=4096)
    try:
        rng, live = random.Random(3), {}
        for _ in range(400):
            if live and rng.random() < 0.5:
                piece = rng.choice(list(live))
                arena.free([piece.slot])
                del live[piece]
                continue
            values = np.full(rng.randint(1, 120), rng.randint(0, 1 << 40), dtype=np.int64)
            piece = arena.put(values)
            if piece is not None:  # None: no contiguous room now, the bytes go the ordinary way
                live[piece] = values
            for kept, want in live.items():  # nothing written since has clobbered a live slot
                assert np.array_equal(shm.view(kept), want)
        assert sum(1 for entry in arena._live if not entry[3]) == len(live)  # slots not freed
    finally:
        arena.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=40))
def test_partition_fifo_reads_match_a_scan_of_the_ready_rows(ops: list[tuple[int, int, int]]) -> None:
    """The per-partition ready heaps give what the policy over every ready row would: the lowest
    ready indices of the partition, all-or-nothing at ``min_size``, across interleaved partitions
    and reads of the whole task."""
    from sluice.queue.controller import TaskController

    ctl, next_row, ready = TaskController("t", ["x"]), 0, {}
    ctl.declare({0: 10**6, 1: 10**6})
    for kind, a, b in ops:
        if kind == 0:  # a put of a + 1 rows into partition b % 2
            metas = [RowMeta(i, i, 0, 1, partition=b % 2) for i in range(next_row, next_row + a + 1)]
            ctl.notify_ready(metas, ["x"])
            ready.update((m.index, m.partition) for m in metas)
            next_row += a + 1
            continue
        part = None if kind == 1 else b % 2
        rows = sorted(i for i, p in ready.items() if part is None or p == part)
        min_size = min(a, 3)
        want = rows[: max(a, min_size)] if len(rows) >= min_size else None
        got = ctl.select(["x"], max(a, min_size), "fifo", None, min_size, part)
        assert (None if got is None else [m.index for m in got]) == want
        for i in want or []:
            del ready[i]
