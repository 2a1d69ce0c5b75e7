"""Checkpoint files (atomic write, completeness, retention, resume resolution) and the round trip
of every state part: RNG, the queue's untrained rows, the asynchronous controller's books, the
trainer worker's weights + optimizer + version."""

import asyncio
import json
import random

import numpy as np
import pytest
import torch
from test_trainer_worker import _groups

from fakes import FakePipeline
from sluice.api import RowMeta
from sluice.config import TrainerConfig
from sluice.controller.checkpoint import (
    COMPLETE,
    DRIVER_STATE,
    CheckpointError,
    CheckpointStore,
    config_changes,
    log_sizes,
    open_run,
    read_driver_state,
    truncate_log,
    write_driver_state,
)
from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.queue import LocalQueue
from sluice.queue.samples import SAMPLE_COLUMNS, samples_to_rows
from sluice.queue.snapshot import groups_snapshot
from sluice.schedule.ledger import GroupLedger, GroupState
from sluice.schedule.staleness import StalenessGate
from sluice.trainer.rng_state import capture_rng, restore_rng
from sluice.trainer.worker import TRAIN_TASK, TrainerWorker
from sluice.weights import InProcessWeightSync
from tiny import tiny_llama


def _write(store, version, payload="x"):
    tmp = store.begin(version)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "weights.bin").write_text(payload)
    write_driver_state(tmp, {"version": version})
    return store.commit(tmp, version)


def test_half_written_checkpoints_are_ignored_by_resume_auto(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    done = _write(store, 2)
    half = store.begin(4)  # a crash mid-write: never renamed
    write_driver_state(half, {"version": 4})
    renamed_by_hand = tmp_path / "checkpoints" / "step_000006"  # a folder without its manifest
    renamed_by_hand.mkdir()
    (renamed_by_hand / DRIVER_STATE).write_bytes(b"")
    lost_file = _write(store, 8)
    (lost_file / "trainer" / "weights.bin").unlink()  # the manifest lists a file that is gone
    assert open_run(tmp_path, "auto")[1] == [done]
    assert read_driver_state(done) == {"version": 2}
    assert store.complete() == [done]
    _write(store, 10)  # the next write clears the crashed temp folder
    assert not half.exists()


def test_resume_path_that_is_not_a_complete_checkpoint_names_the_path(tmp_path):
    store = CheckpointStore(tmp_path)
    half = store.begin(2)
    with pytest.raises(CheckpointError, match=str(half)):
        open_run(tmp_path, str(half))
    with pytest.raises(CheckpointError, match="not a folder"):
        open_run(tmp_path, str(tmp_path / "nowhere"))
    assert open_run(tmp_path, str(_write(store, 2)))[1] == [tmp_path / "checkpoints" / "step_000002"]
    assert open_run(tmp_path / "fresh", "auto")[1] == []  # auto on a new run starts fresh


def test_only_the_newest_k_stay_and_a_resume_drops_newer_ones(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for version in (1, 2, 3, 4):
        _write(store, version)
    assert [p.name for p in store.complete()] == ["step_000003", "step_000004"]
    manifest = json.loads((store.latest() / COMPLETE).read_text())
    assert manifest["version"] == 4 and sorted(manifest["files"]) == [DRIVER_STATE, "trainer/weights.bin"]
    store.drop_newer_than(3)
    assert [p.name for p in store.complete()] == ["step_000003"]
    again = _write(store, 3, payload="new")  # a resumed run writing the same step replaces it
    assert (again / "trainer" / "weights.bin").read_text() == "new"


def test_config_changes_allow_lr_schedule_evaluation_tracking_and_run_control_only():
    saved = {
        "run": {"steps": 10, "resume": None, "seed": 0, "eval_every": 5},
        "trainer": {"lr": 1e-4, "lr_schedule": "constant", "lr_warmup_steps": 0, "clip_high": 0.2},
        "eval": {"samples": 0},
        "tracking": {"trackers": [], "samples_every": 10},
        "rollout": {"group_size": 8},
    }
    same_run = {
        "run": {"steps": 20, "resume": "auto", "seed": 0, "eval_every": 2},
        "trainer": {"lr": 3e-5, "lr_schedule": "cosine", "lr_warmup_steps": 3, "clip_high": 0.2},
        "eval": {"samples": 4},
        "tracking": {"trackers": ["tensorboard"], "samples_every": 1},
        "rollout": {"group_size": 8},
    }
    assert config_changes(saved, same_run) == []
    other = {**same_run, "run": {**same_run["run"], "seed": 1}, "trainer": {**same_run["trainer"], "clip_high": 0.3}}
    other["rollout"] = {"group_size": 4}
    assert config_changes(saved, other) == ["rollout.group_size", "run.seed", "trainer.clip_high"]


def test_logs_are_cut_back_to_their_size_at_the_checkpoint(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n')
    sizes = log_sizes({"metrics": log, "absent": tmp_path / "none.jsonl"})
    assert sizes == {"metrics": 12, "absent": 0}
    with log.open("a") as f:
        f.write('{"step": 2}\n{"st')  # a step redone after resume, and a torn line
    truncate_log(log, sizes["metrics"])
    assert log.read_text() == '{"step": 1}\n'


def test_rng_round_trip_continues_every_stream():
    state = capture_rng()
    first = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def _put_group(queue, gid, columns=("uid", "x")):
    rows = [2 * gid, 2 * gid + 1]
    meta = [RowMeta(i, gid, version=0, num_tokens=3, group_size=2) for i in rows]
    queue.put(rows, {c: [[float(i)] if c == "x" else f"{i}" for i in rows] for c in columns}, meta)


def test_queue_keeps_exactly_the_untrained_written_groups():
    queue = LocalQueue()
    queue.register_task("train", ["uid", "x", "ref"])
    queue.register_task("reference", ["uid"])
    for gid in (0, 1, 2, 3):
        _put_group(queue, gid)
    queue.put([0, 1, 2, 3], {"ref": [[0.0]] * 4})  # groups 0 and 1 have reference log-probs
    queue.get("train", ["uid"], 2, indices=[0, 1])  # group 0 trained
    queue.get("reference", ["uid"], 4, indices=[0, 1, 2, 3])  # the reference read groups 0, 1
    state = groups_snapshot(queue.snapshot(), {1, 3})  # 2 finished after the cut
    fresh = LocalQueue()
    fresh.register_task("train", ["uid", "x", "ref"])
    fresh.register_task("reference", ["uid"])
    fresh.restore(state)
    train = ["uid", "x", "ref"]
    assert sorted(fresh.get("train", train, 8, min_size=0, timeout=0).indices) == [2, 3]  # group 1
    assert sorted(fresh.get("reference", ["uid"], 8, min_size=0, timeout=0).indices) == [2, 3, 6, 7]
    fresh.put([6, 7], {"ref": [[0.0]] * 2})  # the reference redoes group 3; then it is trainable
    batch = fresh.get("train", train, 8, min_size=0, timeout=0)
    assert batch.indices == (6, 7) and list(batch.columns["x"][0]) == [6.0]
    assert fresh.stats()["rows"] == 4


def test_kept_rows_of_a_step_partition_come_back_whole_and_shard_again():
    """A multi-controller run's rows carry their step's partition: the restored queue knows the
    partition's size and rows' tokens, so each trainer rank's shard read of it works again."""
    from sluice.api import Partition, Shard

    queue = LocalQueue()
    queue.register_task("train", ["uid"])
    for gid, tokens in ((0, 5), (1, 9)):  # step 3's two groups of two rows; group 2 is step 4's
        rows = [2 * gid, 2 * gid + 1]
        meta = [RowMeta(i, gid, 0, tokens, 2) for i in rows]
        queue.put(rows, {"uid": [f"{i}" for i in rows]}, meta, partition=Partition(3, 4))
    queue.put([4, 5], {"uid": ["4", "5"]}, [RowMeta(i, 2, 0, 1, 2) for i in (4, 5)], partition=Partition(4, 4))
    fresh = LocalQueue()
    fresh.register_task("train", ["uid"])
    fresh.restore(groups_snapshot(queue.snapshot(), {0, 1, 2}))
    shards = [fresh.get("train", ["uid"], 4, partition=3, shard=Shard(r, 2), timeout=0).indices for r in (0, 1)]
    assert sorted(i for s in shards for i in s) == [0, 1, 2, 3] and all(len(s) == 2 for s in shards)
    assert {frozenset(s) for s in shards} == {frozenset({0, 2}), frozenset({1, 3})}  # one 9-token row each
    whole = fresh.get("train", ["uid"], 4, partition=4, shard=Shard(0, 1), timeout=0)
    assert whole.indices == ()  # 2 of its 4 rows: the split waits for the rest


def test_controller_cut_then_resume_trains_every_admitted_group_exactly_once():
    """η = 2: the fourth step must take groups 12-15 (version 1) and waits for slow group 15,
    while groups 16-23 (admitted at versions 2 and 3) run: 18 and 19 are still generating at the
    cut after it, the others are written. A new controller resumes from the cut and runs to step 8."""

    def slow_tail(gid):
        return {15: 0.02, 18: 0.1, 19: 0.1}.get(gid, 0.001)

    gate = StalenessGate(4, 2)
    first = FakePipeline(slow_tail)
    controller = Controller(first, PushAdmission(first, GroupLedger(gate), 4))
    cuts = []

    async def stop_at_4(version, chosen, metrics):
        if version == 4:
            cuts.append(await controller.admission.cut())
        return version < 4

    asyncio.run(asyncio.wait_for(controller.run(8, stop_at_4), timeout=60))
    cut = cuts[0]
    written = [gid for gid, g in cut.ledger.groups.items() if g.state is GroupState.OPEN and g.generated]
    assert sorted(written) == sorted(cut.reports) == [16, 17, 20, 21, 22, 23]
    assert [gid for _, gid in cut.regenerate] == [18, 19]
    second = FakePipeline(slow_tail)
    second.engine_version = second.trainer_version = 4
    resumed = Controller(second, PushAdmission(second, GroupLedger(gate), 4))

    async def resume_and_run():
        await resumed.admission.resume(cut, 4)

        async def go_on(version, chosen, metrics):
            return True

        await resumed.run(8, go_on)

    asyncio.run(asyncio.wait_for(resume_and_run(), timeout=60))
    trained = [gid for step in first.steps + second.steps for gid in step]
    assert len(trained) == len(set(trained)) == 8 * 4
    assert set(written) | {gid for _, gid in cut.regenerate} <= set(trained)
    ledger = resumed.ledger
    assert ledger.regenerated["restart_groups"] == len(cut.regenerate)
    assert sum(ledger.staleness.values()) == 32 and max(ledger.staleness) <= 2
    assert sum(g.state is GroupState.TRAINED for g in ledger.groups.values()) == 32


def _trainer(model_dir, groups):
    queue = LocalQueue()
    queue.register_task(TRAIN_TASK, SAMPLE_COLUMNS)
    for group in groups:
        queue.put(*samples_to_rows(group, len(group)))
    sync = InProcessWeightSync()
    trainer = TrainerConfig(lr=1e-2, micro_batch_tokens=40)
    worker = TrainerWorker(model_dir, queue, sync, trainer=trainer, temperature=1.0, group_size=4)
    return worker, sync


def _step(worker, group_ids):
    worker.begin_step()
    worker.add_groups(group_ids)
    worker.finish_step()


def test_trainer_worker_state_round_trip_continues_bit_for_bit(tmp_path):
    """Weights, AdamW moments and version survive ``save_state`` / ``load_state``: the next step
    of a restored worker equals the uninterrupted worker's (it would not with fresh moments)."""
    model_dir = tmp_path / "model"
    tiny_llama(0).save_pretrained(model_dir)
    groups = _groups(4)
    whole, _ = _trainer(model_dir, groups)
    _step(whole, [0, 1])
    whole.save_state(str(tmp_path / "ckpt"))
    after_one = whole.engine.export_weights()
    _step(whole, [2, 3])
    restored, sync = _trainer(model_dir, groups[2:])
    assert restored.load_state(str(tmp_path / "ckpt")) == 1
    published = sync.fetch(1)  # republished for the engines
    assert all(torch.equal(published[k], v) for k, v in after_one.items())
    _step(restored, [2, 3])
    assert restored.version == whole.version == 2
    assert sorted(restored.trained_ids()) == sorted(f"{g}-{k}" for g in (2, 3) for k in range(4))
    final, expected = restored.engine.export_weights(), whole.engine.export_weights()
    assert all(torch.equal(final[k], v) for k, v in expected.items())


def test_cli_resume_shorthand_is_run_resume():
    from sluice.cli import _split_args

    assert _split_args(["cfg.yaml", "resume=auto", "run.steps=3"]) == (["cfg.yaml"], ["run.resume=auto", "run.steps=3"])


def test_a_changed_file_fails_the_checksum_before_anything_is_unpickled(tmp_path):
    from sluice.controller.checkpoint import verify_checkpoint

    store = CheckpointStore(tmp_path)
    tmp = store.begin(3)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "shard.bin").write_bytes(b"x" * 100)
    (tmp / DRIVER_STATE).write_bytes(b"state")
    path = store.commit(tmp, 3)
    verify_checkpoint(path)  # as written
    (path / "trainer" / "shard.bin").write_bytes(b"y" * 100)  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"shard\.bin does not match the checksum"):
        verify_checkpoint(path)
