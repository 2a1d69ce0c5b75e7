"""The checkpoint store cannot mislead: one run per run dir, nothing destroyed before the resumed
checkpoint verified, fallback past a damaged checkpoint (kept on disk), the data files' fingerprint,
the format version, and driver state in JSON that builds only allowed classes."""

import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from sluice.api import GroupReport, PromptItem
from sluice.config import load_config
from sluice.controller import checkpoint
from sluice.controller.checkpoint import (
    COMPLETE,
    DRIVER_STATE,
    FORMAT_VERSION,
    RUN_FILE,
    CheckpointError,
    CheckpointStore,
    open_run,
    write_driver_state,
)
from sluice.controller.consistency import check_consistent
from sluice.controller.resume import STATE_CLASSES, AsyncCut, DriverState, open_checkpoints, read_driver_state
from sluice.controller.state_codec import StateCodecError, dumps, loads
from sluice.schedule.ledger import GroupLedger, GroupState
from sluice.schedule.staleness import StalenessGate
from sluice.trainer.rng_state import capture_rng
from sluice.trainer.worker import TRAINER_STATE

LINE = '{"s": 0000}\n'
"""A 12-byte record; ``_run_with_checkpoints`` records 12 bytes of log per version."""


def _config(tmp_path, *overrides):
    return load_config(None, [f"run.output_dir={tmp_path}", "run.name=r", "run.keep_checkpoints=3", *overrides])


def _state(config, version, logs=None):
    cut = AsyncCut(next_group=version * 4, ledger=GroupLedger(StalenessGate(4, 0)), reports={}, regenerate=[])
    return DriverState(
        version, "async", config.model_dump(mode="json"), version * 4, None, logs or {}, capture_rng(), cut
    )


def _commit(store, config, version, logs=None):
    tmp = store.begin(version)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "weights.bin").write_bytes(bytes(range(256)) * 4)
    torch.save({"version": version, "rng": {}}, tmp / "trainer" / TRAINER_STATE)
    write_driver_state(tmp, _state(config, version, logs), STATE_CLASSES)
    return store.commit(tmp, version)


def config_run_dir(config):
    return Path(config.run.output_dir) / config.run.name


def _run_with_checkpoints(tmp_path, versions=(2, 4, 6), *overrides):
    config = _config(tmp_path, *overrides)
    store, _, _ = open_checkpoints(config, config_run_dir(config))
    paths = [_commit(store, config, v, {"trained_ids.jsonl": len(LINE) * v}) for v in versions]
    (config_run_dir(config) / "trained_ids.jsonl").write_text(LINE * versions[-1] + "y" * 5)
    return config, store, paths


def test_a_fresh_run_into_a_run_dir_with_checkpoints_is_refused_and_auto_continues_it(tmp_path):
    config, store, paths = _run_with_checkpoints(tmp_path)
    run_dir = config_run_dir(config)
    assert json.loads((run_dir / RUN_FILE).read_text())["run_id"] == store.run_id
    assert all(json.loads((p / COMPLETE).read_text())["run_id"] == store.run_id for p in paths)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints.*resume=auto.*run\.name") as err:
        open_checkpoints(config, run_dir)
    assert "\n" not in str(err.value)
    assert [p.name for p in paths] == sorted(p.name for p in (run_dir / "checkpoints").iterdir())  # untouched
    resumed, path, state = open_checkpoints(_config(tmp_path, "run.resume=auto"), run_dir)
    assert (resumed.run_id, path, state.version) == (store.run_id, paths[-1], 6)


def test_pruning_and_temp_cleanup_touch_only_this_run(tmp_path):
    other = CheckpointStore(tmp_path, keep=5, run_id="other")
    config = _config(tmp_path)
    theirs = [_commit(other, config, v) for v in (8, 10)]
    their_tmp = other.begin(12)  # their crashed write
    mine = CheckpointStore(tmp_path, keep=1, run_id="mine")
    for version in (2, 4, 6):
        _commit(mine, config, version)
    assert [p.name for p in mine.complete()] == ["step_000006"]
    assert all(p.is_dir() for p in theirs) and their_tmp.is_dir()
    assert [p.name for p in other.complete()] == ["step_000008", "step_000010"]


def test_resume_path_into_a_run_dir_of_another_run_is_refused(tmp_path):
    config, _, paths = _run_with_checkpoints(tmp_path)
    other = CheckpointStore(tmp_path / "b", run_id="b")
    _commit(other, config, 2)
    with pytest.raises(CheckpointError, match=r"holds checkpoints of another run \(b\)"):
        open_run(tmp_path / "b", str(paths[0]))


def test_a_truncated_file_falls_back_to_the_previous_checkpoint_and_nothing_is_deleted(tmp_path, caplog):
    config, _, paths = _run_with_checkpoints(tmp_path)
    weights = paths[-1] / "trainer" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    log = config_run_dir(config) / "trained_ids.jsonl"
    with caplog.at_level(logging.WARNING):
        store, path, state = open_checkpoints(_config(tmp_path, "run.resume=auto"), config_run_dir(config))
    assert (path, state.version) == (paths[1], 4)
    rejected = paths[-1].with_name("step_000006.rejected")
    assert (rejected / "trainer" / "weights.bin").stat().st_size == 100 and (rejected / DRIVER_STATE).is_file()
    lines = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert len(lines) == 1 and "step_000006" in lines[0] and "has 100 bytes" in lines[0]
    assert log.read_text() == LINE * 4  # cut back to the fallback checkpoint's size
    assert [p.name for p in store.complete()] == ["step_000002", "step_000004"]
    _commit(store, config, 6)  # the run goes on: the rejected one stays, and is not counted
    _commit(store, config, 8)
    assert rejected.is_dir() and [p.name for p in store.complete()] == ["step_000004", "step_000006", "step_000008"]


def test_no_usable_checkpoint_is_one_error_and_nothing_is_touched(tmp_path):
    config, _, paths = _run_with_checkpoints(tmp_path, (2, 4))
    for path in paths:
        (path / DRIVER_STATE).write_text("{}")  # damaged: its size no longer matches
    before = sorted(p.name for p in (config_run_dir(config) / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*step_000004.*step_000002") as err:
        open_checkpoints(_config(tmp_path, "run.resume=auto"), config_run_dir(config))
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in (config_run_dir(config) / "checkpoints").iterdir()) == before
    assert (config_run_dir(config) / "trained_ids.jsonl").read_text().endswith("y" * 5)  # not cut


def test_an_explicit_resume_path_that_fails_verification_does_not_fall_back(tmp_path):
    config, _, paths = _run_with_checkpoints(tmp_path)
    (paths[1] / "trainer" / "weights.bin").write_bytes(b"\0" * 1024)
    with pytest.raises(CheckpointError, match=r"weights\.bin does not match the checksum"):
        open_checkpoints(_config(tmp_path, f"run.resume={paths[1]}"), config_run_dir(config))
    assert all(p.is_dir() for p in paths)  # the newer one is not dropped either


def test_a_changed_data_file_is_refused_naming_it(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "12", "answer": "21"}\n')
    config, _, paths = _run_with_checkpoints(tmp_path, (2,), f"data.train_files={data}")
    assert json.loads((paths[0] / COMPLETE).read_text())["data"] == {str(data): checkpoint._sha256(data)}
    resume = _config(tmp_path, f"data.train_files={data}", "run.resume=auto")
    open_checkpoints(resume, config_run_dir(config))  # unchanged: resumes
    data.write_text('{"prompt": "13", "answer": "31"}\n')
    with pytest.raises(CheckpointError, match=f"data file {data} changed since") as err:
        open_checkpoints(resume, config_run_dir(config))
    assert "\n" not in str(err.value) and paths[0].is_dir()


def test_a_changed_config_is_refused_listing_the_changed_keys_and_what_may_change(tmp_path):
    config, _, _ = _run_with_checkpoints(tmp_path, (2,))
    allowed = _config(tmp_path, "run.resume=auto", "trainer.lr=3e-5", "eval.samples=2", "tracking.samples_every=1")
    open_checkpoints(allowed, config_run_dir(config))  # lr, evaluation, tracking, run control: resumes
    changed = _config(tmp_path, "run.resume=auto", "trainer.clip_high=0.3", "rollout.group_size=4")
    with pytest.raises(CheckpointError) as err:
        open_checkpoints(changed, config_run_dir(config))
    message = str(err.value)
    assert "rollout.group_size, trainer.clip_high changed" in message
    kinds = ("learning rate and schedule (trainer.lr, ", "evaluation (eval.*", "tracking (tracking.*)", "run.steps")
    for kind in kinds:
        assert kind in message
    assert "\n" not in message


def test_an_old_format_checkpoint_names_the_format_versions(tmp_path):
    run_dir = tmp_path / "r"
    old = run_dir / "checkpoints" / "step_000004"  # as an older sluice wrote it: no format, a pickle
    old.mkdir(parents=True)
    (old / "driver.pkl").write_bytes(b"\x80\x05N.")
    (old / COMPLETE).write_text(json.dumps({"version": 4, "files": ["driver.pkl"], "bytes": {}, "sha256": {}}))
    expected = f"format version none .*reads format version {FORMAT_VERSION}"
    with pytest.raises(CheckpointError, match=expected):
        open_checkpoints(_config(tmp_path, "run.resume=auto"), run_dir)
    manifest = json.loads((old / COMPLETE).read_text()) | {"format": 1}
    (old / COMPLETE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"format version 1; this sluice reads format version {FORMAT_VERSION}"):
        open_checkpoints(_config(tmp_path, f"run.resume={old}"), run_dir)


def test_a_new_checkpoint_that_does_not_verify_prunes_nothing(tmp_path, monkeypatch):
    config = _config(tmp_path)
    store = CheckpointStore(tmp_path, keep=1, run_id="r")
    first = _commit(store, config, 2)
    real_fsync = checkpoint._fsync_tree

    def corrupting_fsync(folder):  # a write the disk did not keep
        (folder / "trainer" / "weights.bin").write_bytes(b"\1" * 1024)
        real_fsync(folder)

    monkeypatch.setattr(checkpoint, "_fsync_tree", corrupting_fsync)
    with pytest.raises(CheckpointError, match="does not match the checksum"):
        _commit(store, config, 4)
    assert first.is_dir() and store.complete()[0] == first


def test_driver_state_is_json_and_round_trips_every_part(tmp_path):
    ledger = GroupLedger(StalenessGate(4, 2))
    ledger.admitted(7, 1)
    ledger.finished(7, 1, 4, (1, 1, 0, 1))
    ledger.discards["nan"] = 2
    ledger.staleness[1] = 3
    report = GroupReport(7, 1, 4, 12, (1.0, 0.0, 0.5, float("nan")), sample_versions=(1, 1, 0, 1))
    item = PromptItem(3, "12", (1, 2), {"answer": "21", "nested": {"k": (1, 2)}, "$odd": [1]})
    queue = {"storage": {"meta": [[0, 7, 1, 3, 4, -1]], "columns": {"ref": {"indices": [0], "values": [
        torch.tensor([0.5, -1.25], dtype=torch.bfloat16)]}, "uid": {"indices": [0], "values": ["7-0"]}}}}  # fmt: skip
    cut = AsyncCut(8, ledger, {7: report}, [(item, 9)], queue)
    config = _config(tmp_path)
    state = DriverState(4, "async", config.model_dump(mode="json"), 12, None, {"m": 3}, capture_rng(), cut)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_driver_state(folder, state, STATE_CLASSES)
    text = (folder / DRIVER_STATE).read_text()
    json.loads(text)  # plain JSON, not a pickle
    back = read_driver_state(folder)
    group = back.cut.ledger.groups[7]
    assert group.state is GroupState.OPEN and group.sample_versions == (1, 1, 0, 1)
    assert back.cut.ledger.discards == Counter(nan=2) and back.cut.ledger.staleness == Counter({1: 3})
    assert back.cut.regenerate == [(item, 9)] and back.cut.next_group == 8
    assert back.cut.reports[7].rewards[:3] == (1.0, 0.0, 0.5) and back.cut.reports[7].sample_versions == (1, 1, 0, 1)
    tensor = back.cut.queue["storage"]["columns"]["ref"]["values"][0]
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, queue["storage"]["columns"]["ref"]["values"][0])
    assert back.rng == state.rng and back.config == state.config and back.logs == {"m": 3}


def test_driver_state_builds_only_allowed_classes():
    evil = json.dumps({"$dataclass": ["Popen", {"args": ["touch", "/tmp/x"]}]})
    with pytest.raises(StateCodecError, match="'Popen', which a checkpoint may not hold"):
        loads(evil, {})
    with pytest.raises(StateCodecError, match="unknown tag"):
        loads(json.dumps({"$pickle": "gASV"}), {})
    with pytest.raises(StateCodecError, match=r"cannot store a builtins\.object"):
        dumps({"x": object()}, {})
    with pytest.raises(StateCodecError, match="'StalenessGate', which a checkpoint may not hold"):
        dumps([StalenessGate(4, 1)], {})  # a class the resume could not build fails at the save


def test_rng_state_loads_with_torch_weights_only(tmp_path):
    torch.save({"version": 3, "rng": capture_rng()}, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert state["version"] == 3 and state["rng"] == capture_rng()


@pytest.mark.parametrize("name", ["trained_ids.jsonl", "metrics.jsonl"])
def test_a_log_cut_mid_line_loses_that_line_on_resume_and_says_so(tmp_path, caplog, name):
    """A disk that lost the log's tail: the resume keeps the whole lines, drops the cut one (so the
    next record is not glued onto it) and says so, naming the file."""
    config = _config(tmp_path)
    store, _, _ = open_checkpoints(config, config_run_dir(config))
    _commit(store, config, 2, {name: len(LINE) * 3})
    log = config_run_dir(config) / name
    log.write_text(LINE * 2 + LINE[:5])  # the third line lost its tail
    with caplog.at_level(logging.WARNING):
        open_checkpoints(_config(tmp_path, "run.resume=auto"), config_run_dir(config))
    assert log.read_text() == LINE * 2
    said = [r.getMessage() for r in caplog.records if "cut mid-line" in r.getMessage()]
    assert len(said) == 1 and str(log) in said[0] and "dropped (5 bytes)" in said[0]
    assert "12 bytes less than step_000002" in said[0]


def test_drop_cut_line_keeps_whole_lines_and_reaches_back_past_a_block(tmp_path):
    log = tmp_path / "m.jsonl"
    for text, kept in [("", ""), (LINE, LINE), (LINE + "x" * 9000, LINE), ("x" * 10, "")]:
        log.write_text(text)
        assert checkpoint.drop_cut_line(log) == len(text) - len(kept) and log.read_text() == kept


def _reseal(path):
    """Rewrite ``path``'s manifest for the files it now holds, so it verifies: a tampered checkpoint
    that a checksum cannot catch (a copy under another name, state written by a buggy run)."""
    manifest = json.loads((path / COMPLETE).read_text())
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != COMPLETE)
    manifest["files"] = files
    manifest["bytes"] = {n: (path / n).stat().st_size for n in files}
    manifest["sha256"] = {n: checkpoint._sha256(path / n) for n in files}
    (path / COMPLETE).write_text(json.dumps(manifest))


def _tamper(paths, config, how):
    step6 = paths[-1]
    if how == "folder":  # step_000006 is really step 4's checkpoint, copied over it
        shutil.rmtree(step6)
        shutil.copytree(paths[1], step6)
    elif how == "driver":
        write_driver_state(step6, _state(config, 5), STATE_CLASSES)
    elif how == "trainer":
        torch.save({"version": 5, "rng": {}}, step6 / "trainer" / TRAINER_STATE)
    elif how == "queue":  # rows of a group the driver's books have no report of
        state = _state(config, 6)
        state.cut.queue = {"storage": {"meta": [[0, 3, 0]], "columns": {}, "freed": []}, "tasks": {}}
        write_driver_state(step6, state, STATE_CLASSES)
    elif how == "ledger":  # a group trained at a step after the checkpoint's
        state = _state(config, 6)
        state.cut.ledger.admitted(3, 6)
        state.cut.ledger.groups[3].trained_at = 7
        write_driver_state(step6, state, STATE_CLASSES)
    _reseal(step6)


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("folder", "its folder name says step 6, its manifest version 4"),
        ("driver", "its folder name says step 6, its driver state (driver.json) version 5"),
        ("trainer", "its driver state says version 6, its trainer state (trainer/trainer_state.pt) 5"),
        ("queue", "the queue snapshot holds rows of group 3, which has no report in the driver state"),
        ("ledger", "the ledger has group 3 trained at step 7, after step 6"),
    ],
)
def test_an_inconsistent_checkpoint_is_set_aside_and_the_previous_one_used(tmp_path, caplog, how, says):
    config, _, paths = _run_with_checkpoints(tmp_path)
    _tamper(paths, config, how)
    with caplog.at_level(logging.WARNING):
        store, path, state = open_checkpoints(_config(tmp_path, "run.resume=auto"), config_run_dir(config))
    assert (path, state.version) == (paths[1], 4)
    said = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert len(said) == 1 and "step_000006 is inconsistent: " + says in said[0], said
    assert paths[-1].with_name("step_000006.rejected").is_dir() and not paths[-1].exists()
    assert [p.name for p in store.complete()] == ["step_000002", "step_000004"]  # nothing deleted


def test_a_checkpoint_not_believed_at_its_write_is_set_aside_and_nothing_is_pruned(tmp_path):
    config = _config(tmp_path)
    store = CheckpointStore(config_run_dir(config), keep=1, run_id="r")
    first = _commit(store, config, 2)
    tmp = store.begin(4)
    (tmp / "trainer").mkdir()
    torch.save({"version": 3, "rng": {}}, tmp / "trainer" / TRAINER_STATE)  # a trainer a step behind
    write_driver_state(tmp, _state(config, 4), STATE_CLASSES)
    with pytest.raises(CheckpointError, match=r"step_000004 is inconsistent: .*trainer state"):
        store.commit(tmp, 4, lambda p: check_consistent(p, read_driver_state(p).version, read_driver_state(p).cut))
    assert store.complete() == [first]  # the older one kept: the new one was not believed
    assert (first.parent / "step_000004.rejected" / "trainer" / TRAINER_STATE).is_file()
