"""Pieces of the multi-controller DAG runtime without Ray: the admission gate's credits, the
distributed prompt loader's shards and cursors, and how the driver transport tells sample bytes."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
from distflow.data_nodes import IndexPrompts
from distflow.gate import AdmissionGate
from distflow.transport import DriverTransport, payload_bytes

from sluice.api import Batch, RowMeta
from sluice.dag.loader import ShardLoader, shard_range
from sluice.queue.packed import PackedColumn, offsets_of


def test_gate_credits_never_run_more_than_eta_steps_ahead():
    rng = random.Random(0)
    for eta in (0, 1, 2):
        gate = AdmissionGate(groups_per_step=4, max_staleness=eta, steps=6, consumers=2)
        granted = []
        while gate.granted < gate.total:
            got = gate.acquire(rng.randint(1, 5), timeout=0)
            granted += got
            for g, v in got:
                assert g // 4 - v <= eta  # the group's step is at most η past the version it is made with
            if not got or rng.random() < 0.3:  # consumers finish the oldest unfinished step
                step = gate.version
                gate.step_done(step)
                gate.step_done(step)
        assert [g for g, _ in granted] == list(range(24)) and gate.acquire(1, timeout=0) == []
        assert gate.max_lead == eta


def test_gate_version_waits_for_every_consumer_and_wakes_a_waiting_generator():
    gate = AdmissionGate(groups_per_step=2, max_staleness=0, steps=2, consumers=2)
    assert gate.acquire(5) == [(0, 0), (1, 0)]
    got: list = []
    waiter = threading.Thread(target=lambda: got.extend(gate.acquire(5, timeout=10)))
    waiter.start()
    assert gate.step_done(0) == 0 and not got  # one of two consumers done: still version 0
    assert gate.step_done(0) == 1
    waiter.join(5)
    assert got == [(2, 1), (3, 1)]


def test_shards_are_contiguous_regions_and_cursors_restore():
    assert [list(shard_range(10, r, 3)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    loader = ShardLoader(IndexPrompts(10), 1, 3)
    assert loader.take(5) == [3, 4, 5, 3, 4] and loader.cursor() == {"rank": 1, "size": 3, "epoch": 1, "position": 2}
    again = ShardLoader(IndexPrompts(10), 1, 3)
    again.restore(loader.cursor())
    assert again.take(2) == loader.take(2) == [5, 3]
    with pytest.raises(ValueError, match="cursor of shard 1/3 given to 0/3"):
        ShardLoader(IndexPrompts(10), 0, 3).restore(loader.cursor())
    with pytest.raises(ValueError, match="prompt shard 0 of 3 is empty"):
        ShardLoader(IndexPrompts(2), 0, 3)


def test_transport_counts_column_payloads_as_sample_bytes_and_control_as_not():
    transport = DriverTransport(frozenset({"response_ids", "reward"}))
    tokens = PackedColumn(np.arange(4000, dtype=np.int32), offsets_of([1000] * 4), "list")
    transport._measure(("score", 3, {"loss": 0.5}))  # control: a node id, a step, metrics
    assert transport.counts.sample == 0
    transport._measure(({"response_ids": tokens, "reward": [0.0] * 4},))
    batch = Batch((0, 1, 2, 3), {"response_ids": tokens}, tuple(RowMeta(i, 0, 0, 1000) for i in range(4)))
    assert transport.counts.sample >= 16_000
    before = transport.counts.sample
    transport._measure(("score", 0, batch))
    assert transport.counts.sample - before >= 16_000
    assert 16_000 <= payload_bytes(tokens) < 17_000  # the buffer counted once, out of band


def test_synthetic_rows_are_position_plus_row_mod_vocab_and_checksums_read_every_token():
    from distflow.data_nodes import VOCAB, synthetic_generate, token_checksum

    from sluice.dag.functions import NodeContext
    from sluice.dag.spec import DagNode

    gen = DagNode(id="gen", role="rollout", type="generate", reads=("prompt",), writes=("tokens", "reward"),
                  function="synthetic_generate", options={"group_size": 2, "tokens": 300})  # fmt: skip
    ctx = NodeContext(gen)
    groups = [0, 3, 24_999]  # the last group's rows (49,998 and 49,999) wrap around the vocabulary
    prompts = Batch(tuple(groups), {"prompt": groups}, tuple(RowMeta(g, g, 0, 0) for g in groups))
    for _ in range(2):  # the second call reuses the cached table
        out = synthetic_generate(ctx, prompts)
        rows = [2 * g + j for g in groups for j in range(2)]
        expected = [(np.arange(300) + r) % VOCAB for r in rows]
        assert all(np.array_equal(out["tokens"][k], expected[k]) for k in range(len(rows)))
        assert out["reward"] == [float(r % 2) for r in rows]
    score = DagNode(id="score", role="reward", type="compute", reads=("tokens",), writes=("sum",),
                    function="token_checksum")  # fmt: skip
    sums = token_checksum(NodeContext(score), Batch(tuple(rows), {"tokens": out["tokens"]}, ()))
    assert sums["sum"] == [int(e.sum()) for e in expected]
