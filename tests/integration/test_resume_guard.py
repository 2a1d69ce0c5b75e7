"""Resume that cannot mislead, end to end on a tiny real model: a damaged newest checkpoint falls
back to the previous one (kept on disk, every sample still trained once), and a fresh run into a
run dir that holds checkpoints stops with one line from the CLI."""

import subprocess
import sys

import pytest
from test_resume import _fit, _records, _run, trained_ids

from sluice.controller.checkpoint import CheckpointError

pytestmark = pytest.mark.integration


def test_a_truncated_checkpoint_falls_back_and_every_sample_is_trained_once(tiny_task_model, tmp_path):
    sync = ["run.mode=sync", "run.backend=local", "run.checkpoint_every=2", "run.keep_checkpoints=2"]
    _fit(tiny_task_model, tmp_path, "cut", *sync, "run.steps=4")
    ckpts = tmp_path / "cut" / "checkpoints"
    weights = next((ckpts / "step_000004" / "trainer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])  # a disk that lost the file's tail
    resumed = _fit(tiny_task_model, tmp_path, "cut", *sync, "run.steps=6", "run.resume=auto")
    ids, steps = trained_ids(resumed.run_dir)
    assert steps == [1, 2, 3, 4, 5, 6] and set(ids.values()) == {1} and len(ids) == 6 * 4 * 4
    rejected = ckpts / "step_000004.rejected" / "trainer" / weights.name
    assert rejected.is_file()  # kept as it was, out of the way
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "step_000004.rejected", "step_000006"]


def test_a_fresh_run_into_a_run_dir_with_checkpoints_stops_with_one_line(tiny_task_model, tmp_path):
    sync = ["run.mode=sync", "run.backend=local", "run.steps=2"]
    _fit(tiny_task_model, tmp_path, "taken", *sync, "run.checkpoint_every=2")
    args = _run(tiny_task_model, tmp_path, "taken", *sync)
    done = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "train", *args], capture_output=True, text=True, timeout=600
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "already holds checkpoints" in lines[0] and "resume=auto" in lines[0]
    assert (tmp_path / "taken" / "checkpoints" / "step_000002").is_dir()


def test_a_resume_may_change_the_learning_rate_and_schedule_and_nothing_that_computes(tiny_task_model, tmp_path):
    """The new ``trainer.lr`` and schedule apply from the checkpoint on (the ``lr`` metric shows
    it); a change of what the run computes is refused naming the key and what may change."""
    sync = ["run.mode=sync", "run.backend=local", "run.checkpoint_every=2"]
    _fit(tiny_task_model, tmp_path, "lr", *sync, "run.steps=2")
    changed = ["trainer.lr=1e-3", "trainer.lr_schedule=linear", "eval.samples=2", "tracking.samples_every=1"]
    resumed = _fit(tiny_task_model, tmp_path, "lr", *sync, *changed, "run.steps=4", "run.resume=auto")
    train = [r for r in _records(resumed.run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[1]["lr"] == pytest.approx(3e-3)  # tiny_run_overrides' constant rate before the resume
    assert train[2]["lr"] == pytest.approx(1e-3 * 2 / 4) and train[3]["lr"] == pytest.approx(1e-3 * 1 / 4)
    with pytest.raises(CheckpointError, match=r"rollout\.group_size changed; a resume may change only learning"):
        _fit(tiny_task_model, tmp_path, "lr", *sync, "rollout.group_size=2", "run.steps=4", "run.resume=auto")
