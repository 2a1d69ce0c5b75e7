"""A tiny training run's trackers, samples and plot, end to end, on both backends.

The records read back from TensorBoard's event files and wandb's offline run file must be the
ones ``metrics.jsonl`` holds; ``samples.jsonl`` holds decoded samples the step trained, each with
the reward its text earned. wandb runs offline and silent.
"""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from tiny import tiny_run_overrides
from wandb_log import history_rows, read_records

pytestmark = pytest.mark.integration

SAMPLE_FIELDS = {"step", "group_id", "uid", "version", "staleness", "reward", "prompt", "response"}


def _fit(model_dir, out, name, *overrides):
    """(the run's folder, its training prompts' texts)."""
    small = ["rollout.max_new_tokens=12", "reward.pool_size=0", "task.eval_prompts=4", "run.steps=2"]
    cfg = load_config(None, [*tiny_run_overrides(model_dir, out, name), *small, *overrides])
    trainer = RLTrainer(cfg, reward=length_reward)
    return trainer.fit().run_dir, {item.prompt for item in trainer.prompts.items}


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_samples(run_dir, steps, per_step, prompts):
    """Each due step's samples: the fields, ids the step trained, the reward of the decoded text."""
    samples = _jsonl(run_dir / "samples.jsonl")
    trained = {r["step"]: set(r["ids"]) for r in _jsonl(run_dir / "trained_ids.jsonl")}
    assert [r["step"] for r in samples] == [s for s in steps for _ in range(per_step)]
    for row in samples:
        assert set(row) >= SAMPLE_FIELDS
        assert row["uid"] in trained[row["step"]] and row["uid"].startswith(f"{row['group_id']}-")
        assert row["staleness"] == row["step"] - 1 - row["version"] >= 0
        assert row["prompt"] in {f"<bos>{p}" for p in prompts}  # as the model saw it: with its special tokens
        assert row["reward"] == length_reward(row["response"])
    return samples


def test_local_run_writes_trackers_samples_and_plot(tiny_task_model, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    tracking = ["tracking.trackers=[tensorboard,wandb]", "tracking.samples_every=1", "tracking.samples_per_step=3"]
    tracking += ["tracking.plot=true"]
    trainer_overrides = ["run.mode=sync", "run.backend=local", *tracking]
    run_dir, prompts = _fit(tiny_task_model, tmp_path, "tracked", *trainer_overrides)
    metrics = _jsonl(run_dir / "metrics.jsonl")
    train = {r["step"]: r for r in metrics if r["kind"] == "train"}
    evals = [(r["step"], r["accuracy"]) for r in metrics if r["kind"] == "eval"]
    assert sorted(train) == [1, 2] and [s for s, _ in evals] == [0, 2]

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for key in ("reward_mean", "response_len_mean", "tokens_per_s", "loss"):
        got = [(e.step, e.value) for e in acc.Scalars(f"train/{key}")]
        assert got == [(s, pytest.approx(train[s][key], rel=1e-6)) for s in (1, 2)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == evals
    assert [e.step for e in acc.Tensors("samples/text_summary")] == [1, 2]

    import wandb

    wandb.teardown()  # the service finishes writing the run file
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = history_rows(read_records(run_file))
    logged = {row["step"]: row["train/reward_mean"] for row in rows if "train/reward_mean" in row}
    assert logged == {s: train[s]["reward_mean"] for s in (1, 2)}
    assert len(list(run_dir.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))) == 2

    _check_samples(run_dir, [1, 2], 3, prompts)
    png = (run_dir / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_ray_run_returns_its_samples_from_the_trainer_actor(tiny_task_model, tmp_path, ray_cluster):
    """The Ray trainer actor returns the summaries (token ids); the driver decodes them. η = 1:
    a sample's staleness is the trained version minus its own."""
    overrides = ["run.mode=async", "run.backend=ray", "rollout.max_staleness=1", "tracking.plot=false"]
    overrides += ["tracking.samples_every=2", "tracking.samples_per_step=5"]
    run_dir, prompts = _fit(tiny_task_model, tmp_path, "ray", *overrides)
    samples = _check_samples(run_dir, [2], 5, prompts)
    assert len({r["uid"] for r in samples}) == 5
    assert not (run_dir / "plot.png").exists() and not (run_dir / "tensorboard").exists()


def test_resume_cuts_samples_back_and_continues_the_trackers(tiny_task_model, tmp_path, monkeypatch):
    """Resumed from step 1's checkpoint, step 2 is redone: its samples are logged once, and the
    wandb run continues under the same id (a second offline run folder of that id)."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    overrides = ["run.mode=sync", "run.backend=local", "run.checkpoint_every=1", "tracking.plot=false"]
    overrides += ["tracking.trackers=[wandb]", "tracking.samples_every=1", "tracking.samples_per_step=2"]
    run_dir, prompts = _fit(tiny_task_model, tmp_path, "cut", *overrides)
    step1 = run_dir / "checkpoints" / "step_000001"
    _fit(tiny_task_model, tmp_path, "cut", *overrides, f"run.resume={step1}")
    _check_samples(run_dir, [1, 2], 2, prompts)

    import wandb

    wandb.teardown()
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name
    steps = [row["step"] for f in files for row in history_rows(read_records(f)) if "train/reward_mean" in row]
    assert steps == [1, 2, 2]  # the redone step is in the continued run
