"""TransferQueue semantics on the in-process backend.

Tests that take ``make_queue`` are backend-independent: ``tests/integration/test_queue_ray.py``
runs the same functions against ``RayQueue``.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from sluice.api import QueueClient, RowMeta
from sluice.queue import POLICIES, AsyncLocalQueue, InMemoryStorageUnit, LocalQueue, QueueIterableDataset
from sluice.queue.storage import PackedColumn

torch.set_num_threads(1)

MakeQueue = Callable[..., QueueClient]


@pytest.fixture(params=[1, 3, "fake"], ids=["1unit", "3units", "2fake-units"])
def make_queue(request) -> MakeQueue:
    """The queue over its own storage units, or over ``FakeStorageUnit`` s (the queue may use
    only the ``StorageUnit`` Protocol)."""
    from fakes import FakeStorageUnit

    def make(num_units: int | None = None) -> QueueClient:
        if request.param == "fake":
            return LocalQueue(num_storage_units=num_units or 2, unit_factory=FakeStorageUnit)
        return LocalQueue(num_storage_units=num_units or request.param)

    return make


def meta(i: int, group: int | None = None, version: int = 0, size: int = 1) -> RowMeta:
    return RowMeta(index=i, group_id=i if group is None else group, version=version, num_tokens=i, group_size=size)


def drain(q: QueueClient, task: str, columns: list[str], batch_size: int = 7) -> list[int]:
    seen: list[int] = []
    while batch := q.get(task, columns, batch_size, timeout=0):
        seen.extend(batch.indices)
    return seen


# ---------------------------------------------------------------- shared semantics (both backends)


def test_readiness_across_puts(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("ref", ["tokens", "ref_logp"])
    q.put([0, 1, 2, 3], {"tokens": [[1, 2], [3], [4, 5, 6], []]}, [meta(i) for i in range(4)])
    assert len(q.get("ref", ["tokens", "ref_logp"], 4, timeout=0)) == 0
    q.put([2, 1], {"ref_logp": [[-0.5, -1.0, -1.5], [-0.25]]})
    batch = q.get("ref", ["tokens", "ref_logp"], 4, timeout=0)
    assert batch.indices == (1, 2)
    assert batch.columns == {"tokens": [[3], [4, 5, 6]], "ref_logp": [[-0.25], [-0.5, -1.0, -1.5]]}
    assert [m.num_tokens for m in batch.meta] == [1, 2]
    # a subset of the registered columns is ready earlier
    assert q.get("ref", ["tokens"], 4, timeout=0).indices == (0, 3)


def test_exactly_once_and_independent_tasks(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("a", ["x"])
    q.register_task("b", ["x"])
    for start in range(0, 20, 5):
        q.put(list(range(start, start + 5)), {"x": [[i] * i for i in range(start, start + 5)]})
    got_a = drain(q, "a", ["x"])
    assert sorted(got_a) == list(range(20)) and len(got_a) == 20
    assert drain(q, "a", ["x"]) == []
    batch = q.get("b", ["x"], 20, timeout=0)
    assert batch.indices == tuple(range(20))
    assert batch.columns["x"] == [[i] * i for i in range(20)]


def test_late_registration_sees_existing_rows(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.put([0, 1, 2], {"x": [1, 2, 3]})
    q.put([1], {"y": ["b"]})
    q.register_task("late", ["x", "y"])
    assert q.get("late", ["x", "y"], 3, timeout=0).columns == {"x": [2], "y": ["b"]}
    q.put([0], {"y": ["a"]})
    assert q.get("late", ["x", "y"], 3, timeout=0).indices == (0,)


def test_policies(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("t", ["x", "y"])
    rows = [meta(5, version=0), meta(3, version=2), meta(9, version=1), meta(1, version=2), meta(7, version=2)]
    q.put([m.index for m in rows], {"x": [0] * 5}, rows)
    assert q.get("t", ["x"], 2, timeout=0).indices == (1, 3)
    assert q.get("t", ["x"], 3, policy="oldest_version", timeout=0).indices == (5, 9, 7)
    # groups of 3 in column y: group 20 complete (v1), group 10 has 2 of 3 rows, group 30 complete (v0)
    grouped = [meta(20, 20, 1, 3), meta(21, 20, 1, 3), meta(22, 20, 1, 3), meta(10, 10, 0, 3), meta(11, 10, 0, 3)]
    grouped += [meta(30, 30, 0, 3), meta(31, 30, 0, 3), meta(32, 30, 0, 3)]
    q.put([m.index for m in grouped], {"y": [0] * len(grouped)}, grouped)
    assert q.get("t", ["y"], 5, policy="groups", timeout=0).indices == (30, 31, 32)
    assert q.get("t", ["y"], 6, policy="groups", min_size=1, timeout=0).indices == (20, 21, 22)
    assert len(q.get("t", ["y"], 6, policy="groups", timeout=0.05)) == 0
    q.put([12], {"y": [0]}, [meta(12, 10, 0, 3)])
    assert q.get("t", ["y"], 3, policy="groups", timeout=0).indices == (10, 11, 12)


def test_indices_restriction_and_timeout(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("train", ["x"])
    t0 = time.monotonic()
    assert len(q.get("train", ["x"], 4, timeout=0.1)) == 0
    assert time.monotonic() - t0 >= 0.09
    q.put(list(range(10)), {"x": list(range(10))})
    batch = q.get("train", ["x"], 4, indices=[8, 2, 42, 5], min_size=1, timeout=0)
    assert batch.indices == (2, 5, 8) and batch.columns["x"] == [2, 5, 8]
    t0 = time.monotonic()
    assert q.get("train", ["x"], 4, indices=[1, 2, 5], timeout=0.1).indices == (1,)  # partial after timeout
    assert time.monotonic() - t0 >= 0.09
    assert len(drain(q, "train", ["x"])) == 6


def test_waiting_get_is_woken_by_writes_and_close(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("t", ["x", "y"])
    result: list = []
    consumer = threading.Thread(target=lambda: result.append(q.get("t", ["x", "y"], 3, timeout=20)))
    consumer.start()
    q.put([0, 1, 2, 3], {"x": [0, 1, 2, 3]})
    time.sleep(0.05)
    assert not result  # x alone does not make the rows ready
    t0 = time.monotonic()
    q.put([0, 1, 2], {"y": [0, 1, 2]})
    consumer.join(20)
    assert result[0].indices == (0, 1, 2) and time.monotonic() - t0 < 10
    q.put([3], {"y": [3]})
    consumer = threading.Thread(target=lambda: result.append(q.get("t", ["x", "y"], 3)))  # waits, no timeout
    consumer.start()
    time.sleep(0.05)
    q.close()
    consumer.join(20)
    assert result[1].indices == (3,)
    assert len(q.get("t", ["x", "y"], 3)) == 0


def test_variable_length_roundtrip_multi_unit(make_queue: MakeQueue) -> None:
    q = make_queue(2)
    q.register_task("t", ["ids", "lp", "ten", "f", "obj", "tup"])
    rng = random.Random(0)
    n = 40
    ids = [[rng.randrange(1 << 40) for _ in range(rng.randrange(0, 30))] for _ in range(n)]
    lp = [[rng.random() for _ in range(len(r))] for r in ids]
    ten = [torch.randint(0, 100, (rng.randrange(0, 9),)) for _ in range(n)]
    f = [torch.rand(rng.randrange(0, 9), dtype=torch.bfloat16) for _ in range(n)]
    obj = [{"prompt": f"p{i}", "reward": i / 3} if i % 2 else f"s{i}" for i in range(n)]
    tup = [tuple(r[:3]) for r in ids]
    order = rng.sample(range(n), n)
    data: dict[str, list[Any]] = {"ids": ids, "lp": lp, "ten": ten, "f": f, "obj": obj, "tup": tup}
    for cols in (("ids", "ten", "obj"), ("lp", "f", "tup")):
        q.put(order, {c: [data[c][i] for i in order] for c in cols})
    batch = q.get("t", ["ids", "lp", "ten", "f", "obj", "tup"], n, timeout=5)
    assert batch.indices == tuple(range(n))
    assert batch.columns["ids"] == ids and batch.columns["lp"] == lp and batch.columns["obj"] == obj
    assert batch.columns["tup"] == tup and all(type(t) is tuple for t in batch.columns["tup"])
    for got, want in zip([*batch.columns["ten"], *batch.columns["f"]], ten + f, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert q.stats()["rows"] == n


def test_snapshot_restore_roundtrip(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("a", ["x", "y"])
    q.register_task("b", ["x"])
    q.put(list(range(6)), {"x": [[i] * i for i in range(6)]}, [meta(i, version=i % 2) for i in range(6)])
    q.put([0, 1, 2, 3], {"y": [torch.arange(i) for i in range(4)]})
    assert q.get("a", ["x", "y"], 2, timeout=0).indices == (0, 1)
    assert q.get("b", ["x"], 5, timeout=0).indices == (0, 1, 2, 3, 4)
    state = q.snapshot()
    assert all(type(v) is list for v in state["storage"]["columns"]["x"]["values"])  # plain data

    r = make_queue(1)  # a different number of units than the snapshot's (3) is fine
    r.restore(state)
    assert r.get("b", ["x"], 5, timeout=0).indices == (5,)
    batch = r.get("a", ["x", "y"], 6, timeout=0)
    assert batch.indices == (2, 3) and batch.columns["x"] == [[2, 2], [3, 3, 3]]
    assert torch.equal(batch.columns["y"][1], torch.arange(3)) and batch.meta[1] == meta(3, version=1)
    r.put([4, 5], {"y": [torch.arange(4), torch.arange(5)]})
    assert r.get("a", ["x", "y"], 6, timeout=0).indices == (4, 5)
    assert r.stats()["rows"] == 6


def test_clear_frees_rows_consumed_by_every_task(make_queue: MakeQueue) -> None:
    q = make_queue()
    q.register_task("a", ["x"])
    q.register_task("b", ["x"])
    q.put(list(range(6)), {"x": list(range(6))})
    q.get("a", ["x"], 4, timeout=0)
    q.get("b", ["x"], 2, timeout=0)
    assert q.clear() == 2  # rows 0, 1
    assert q.stats()["rows"] == 4
    assert q.clear([5]) == 1
    assert q.get("b", ["x"], 6, timeout=0).indices == (2, 3, 4)
    assert q.stats()["tasks"]["b"]["consumed"] == 3


# ---------------------------------------------------------------- in-process backend only


def test_neighbouring_rows_share_a_unit(make_queue: MakeQueue) -> None:
    """A small put of neighbouring rows lands on one unit; a large one spreads over all of them."""
    q = make_queue(2)
    q.put(list(range(8)), {"x": [[i] for i in range(8)]})
    assert sorted(u["rows"] for u in q.stats()["units"]) == [0, 8]
    q.put(list(range(100, 1124)), {"x": [[i] for i in range(1024)]})
    assert sorted(u["rows"] for u in q.stats()["units"]) == [512, 8 + 512]


def test_concurrent_producers_and_consumers_threads() -> None:
    q = LocalQueue(num_storage_units=2)
    q.register_task("train", ["tokens", "logp"])
    q.register_task("audit", ["tokens"])
    n_producers, rows_each = 4, 60
    data = {i: [random.Random(i).randrange(50_000) for _ in range(i % 97)] for i in range(n_producers * rows_each)}
    consumed: dict[str, list[tuple[int, list[int]]]] = {"train": [], "audit": []}
    lock = threading.Lock()

    def produce(p: int) -> None:
        rng = random.Random(p)
        mine = list(range(p * rows_each, (p + 1) * rows_each))
        while mine:
            k = rng.randint(1, 9)
            chunk, mine = mine[:k], mine[k:]
            q.put(chunk, {"tokens": [data[i] for i in chunk]})
            time.sleep(rng.random() * 0.002)
            q.put(chunk[::-1], {"logp": [[-1.0] * len(data[i]) for i in chunk[::-1]]})

    def consume(task: str, seed: int) -> None:
        rng = random.Random(seed)
        while batch := q.get(task, ["tokens"], rng.randint(1, 8), min_size=1):
            with lock:
                consumed[task].extend(zip(batch.indices, batch.columns["tokens"], strict=True))
            time.sleep(rng.random() * 0.002)

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
    consumers = [threading.Thread(target=consume, args=(t, s)) for s, t in enumerate(["train"] * 3 + ["audit"] * 2)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join()
    q.close()
    for t in consumers:
        t.join(20)
    for task in ("train", "audit"):
        indices = [i for i, _ in consumed[task]]
        assert len(indices) == len(set(indices)) and set(indices) == set(data)
        assert all(tokens == data[i] for i, tokens in consumed[task])


def test_async_client_concurrent_gets() -> None:
    async def main() -> list[int]:
        aq = AsyncLocalQueue(LocalQueue(num_storage_units=2))
        await aq.register_task("t", ["x"])
        consumers = [asyncio.create_task(aq.get("t", ["x"], 5, timeout=10)) for _ in range(4)]
        await asyncio.sleep(0.01)
        for start in range(0, 20, 3):
            await aq.put(list(range(start, min(start + 3, 20))), {"x": [[1]] * len(range(start, min(start + 3, 20)))})
            await asyncio.sleep(0)
        batches = await asyncio.gather(*consumers)
        assert all(len(b) == 5 for b in batches)
        assert len(await aq.get("t", ["x"], 5, timeout=0.01)) == 0
        return [i for b in batches for i in b.indices]

    assert sorted(asyncio.run(main())) == list(range(20))


def test_dataset_streams_batches() -> None:
    q = LocalQueue()
    q.register_task("train", ["x"])
    q.put(list(range(10)), {"x": [[i] for i in range(10)]})
    loader = DataLoader(QueueIterableDataset(q, "train", ["x"], batch_size=4, stop_after=9), batch_size=None)
    assert [b.indices for b in loader] == [(0, 1, 2, 3), (4, 5, 6, 7), (8,)]
    ds = QueueIterableDataset(q, "train", ["x"], batch_size=4, timeout=0.01)
    assert [b.indices for b in ds] == [(9,)]


def test_storage_packs_variable_length_columns_without_padding() -> None:
    unit = InMemoryStorageUnit()
    unit.write([0, 1, 2], {"ids": [[1] * 100, [2], []], "t": [torch.ones(7), torch.ones(1), torch.ones(0)]})
    unit.write([3], {"ids": [[5, 6]]})
    assert unit.stats()["packed_bytes"] == (101 + 2) * 8 + 8 * 4  # flat buffers, no padding
    ids = unit.read([2, 0, 3], ["ids"])["ids"]
    assert isinstance(ids, PackedColumn) and ids.nbytes == 102 * 8  # gathered across puts, still packed
    assert list(ids) == [[], [1] * 100, [5, 6]]
    assert unit.drop([0, 5]) == 1 and unit.stats()["rows"] == 3
    with pytest.raises(KeyError):
        unit.read([0], ["ids"])


def test_packed_column_roundtrip() -> None:
    rows = [torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.zeros(0, dtype=torch.bfloat16)]
    packed = PackedColumn.from_rows(rows)
    assert packed is not None and packed.kind == "tensor" and packed.values.dtype.name == "uint8"
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(packed, rows, strict=True))
    assert PackedColumn.from_rows([(1, 2), (3,)])[1] == (3,)  # type: ignore[index]
    for not_packable in ([[1], (2,)], [["a"]], [[[1, 2], [3]]], [1.0, 2.0], [torch.ones(2, 2)]):
        assert PackedColumn.from_rows(not_packable) is None


def test_errors() -> None:
    q = LocalQueue()
    q.register_task("t", ["x"])
    with pytest.raises(KeyError):
        q.get("nope", ["x"], 1, timeout=0)
    with pytest.raises(ValueError, match="did not register"):
        q.get("t", ["y"], 1, timeout=0)
    with pytest.raises(ValueError, match="min_size"):
        q.get("t", ["x"], 1, min_size=2, timeout=0)
    with pytest.raises(ValueError, match="duplicate"):
        q.put([1, 1], {"x": [0, 0]})
    with pytest.raises(ValueError, match="aligned"):
        q.put([1, 2], {"x": [0, 0]}, [meta(2), meta(1)])
    with pytest.raises(ValueError, match="already registered"):
        q.register_task("t", ["x", "y"])
    with pytest.raises(ValueError, match="unknown policy"):
        q.put([0], {"x": [0]})
        q.get("t", ["x"], 1, policy="random", timeout=0)


row_metas = st.lists(st.builds(lambda g, v: (g, v), st.integers(0, 5), st.integers(0, 3)), max_size=30).map(
    lambda rows: [RowMeta(i, g, v, 1, group_size=2) for i, (g, v) in enumerate(rows)]
)


@settings(max_examples=60, deadline=None)
@given(rows=row_metas, batch_size=st.integers(2, 12))
def test_policies_choose_valid_subsets(rows: list[RowMeta], batch_size: int) -> None:
    for name, policy in POLICIES.items():
        chosen = policy(rows, batch_size)
        assert len(chosen) == len(set(chosen)) <= batch_size
        assert set(chosen) <= {m.index for m in rows}
        if name != "groups":
            assert len(chosen) == min(batch_size, len(rows))
    chosen_groups = [rows[i].group_id for i in POLICIES["groups"](rows, batch_size)]
    assert all(chosen_groups.count(g) == 2 for g in chosen_groups)  # exactly group_size rows per group
    complete = {m.group_id for m in rows if sum(r.group_id == m.group_id for r in rows) >= 2}
    assert len(chosen_groups) == min(2 * len(complete), batch_size - batch_size % 2)


def test_gather_copies_runs_and_keeps_every_row() -> None:
    """``gather`` copies neighbouring rows of one buffer as one slice; rows of equal content from
    another buffer, repeats and reversals still come out row for row."""
    import torch

    from sluice.queue.packed import PackedColumn, gather

    rng = random.Random(0)
    tensors = [PackedColumn.from_rows([torch.arange(rng.randint(0, 9)) for _ in range(50)]) for _ in range(2)]
    tensors.append(PackedColumn.from_rows(list(tensors[0])))  # equal rows, another buffer
    lists = [PackedColumn.from_rows([[rng.random() for _ in range(rng.randint(0, 5))] for _ in range(50)])]
    for trial in range(200):
        group = tensors if trial % 2 else lists
        pieces = []
        for _ in range(rng.randint(0, 30)):
            col, start = rng.choice(group), rng.randrange(50)
            run = range(start, min(50, start + rng.randint(1, 6)))
            pieces += [(col, p) for p in (reversed(run) if rng.random() < 0.2 else run)]
        got, want = list(gather(pieces, group[0])), [col[p] for col, p in pieces]
        assert len(got) == len(want)
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, want, strict=True))


def test_meta_rows_behave_as_a_tuple_of_row_metas() -> None:
    from sluice.queue.packed import MetaRows, metas_to_array

    metas = [RowMeta(i, i // 2, i % 3, 10 + i, group_size=2, partition=i % 2 - 1) for i in range(7)]
    rows = MetaRows(metas_to_array(metas))
    assert rows == metas and rows == tuple(metas) and list(rows) == metas
    assert rows[3] == metas[3] and rows[2:5] == metas[2:5] and rows.take([6, 0]) == [metas[6], metas[0]]
    assert rows.indices() == list(range(7)) and rows != metas[:6]


def test_tensor_rows_pack_into_the_allocators_buffer() -> None:
    import numpy as np

    given: list[np.ndarray] = []

    def alloc(nbytes: int) -> np.ndarray:
        given.append(np.zeros(nbytes + 16, dtype=np.uint8)[8 : 8 + nbytes])
        return given[-1]

    rows = [torch.arange(n, dtype=torch.int64) for n in (3, 0, 5)]
    packed = PackedColumn.from_rows(rows, alloc)
    assert packed is not None and len(given) == 1 and packed.values is given[0]  # no second buffer
    assert all(torch.equal(a, b) for a, b in zip(packed, rows, strict=True))


def test_storage_cell_switches_between_packed_and_object_values() -> None:
    unit = InMemoryStorageUnit()
    unit.write([0, 1], {"x": [[1, 2], [3]]})
    unit.write([1], {"x": ["text"]})  # not packable: row 1 becomes an object cell
    assert list(unit.read([0, 1], ["x"])["x"]) == [[1, 2], "text"]
    unit.write([1], {"x": [[4, 5, 6]]})  # packed again
    got = unit.read([0, 1], ["x"])["x"]
    assert isinstance(got, PackedColumn) and list(got) == [[1, 2], [4, 5, 6]]
    assert unit.stats()["columns"] == {"x": 2}
    catalog = sorted(unit.catalog(), key=lambda c: c[0].index)
    assert catalog == [(RowMeta(0, 0, 0, 0), ("x",)), (RowMeta(1, 1, 0, 0), ("x",))]
