"""Checkpoint / resume end to end on a tiny real model.

``mode: sync`` and the asynchronous pipeline at η = 0 are deterministic, so a run stopped at a
checkpoint and resumed must train exactly the samples of an uninterrupted run (and, in sync, end
on the same weights bit for bit). The SIGKILL test kills a Ray run's driver mid-step with
requests in flight and resumes it with ``resume=auto``.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.engines.hf_model import load_causal_lm
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration


def _run(model_dir, out, name, *overrides):
    """A short run: rewards scored in-thread and a small held-out set keep start-up cheap."""
    small = ["rollout.max_new_tokens=12", "reward.pool_size=0", "task.eval_prompts=4"]
    return [*tiny_run_overrides(model_dir, out, name), *small, *overrides]


def _fit(model_dir, out, name, *overrides):
    return RLTrainer(load_config(None, _run(model_dir, out, name, *overrides)), reward=length_reward).fit()


def _records(run_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def trained_ids(run_dir):
    """Every trained sample id with how often it was trained, and the steps in log order."""
    records = _records(run_dir, "trained_ids.jsonl")
    return Counter(i for r in records for i in r["ids"]), [r["step"] for r in records]


def test_sync_resume_trains_the_same_samples_and_ends_on_the_same_weights(tiny_task_model, tmp_path):
    whole = _fit(tiny_task_model, tmp_path, "whole", "run.mode=sync", "run.backend=local", "run.steps=4")
    _fit(
        tiny_task_model, tmp_path, "cut", "run.mode=sync", "run.backend=local", "run.steps=2", "run.checkpoint_every=2"
    )
    resumed = _fit(
        tiny_task_model, tmp_path, "cut", "run.mode=sync", "run.backend=local", "run.steps=4", "run.resume=auto"
    )
    ids, steps = trained_ids(resumed.run_dir)
    assert steps == [1, 2, 3, 4]
    assert ids == trained_ids(whole.run_dir)[0] and set(ids.values()) == {1}
    keys = ("step", "loss", "grad_norm", "reward_mean")
    train = [tuple(r[k] for k in keys) for r in _records(resumed.run_dir) if r["kind"] == "train"]
    assert train == [tuple(r[k] for k in keys) for r in _records(whole.run_dir) if r["kind"] == "train"]
    a, b = load_causal_lm(whole.final_model_dir).state_dict(), load_causal_lm(resumed.final_model_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_async_eta1_resume_trains_every_admitted_group_once(tiny_task_model, tmp_path):
    """η = 1 keeps groups both written and generating across the checkpoint: the written ones come
    back from the queue snapshot, the others are regenerated (counted); each is trained once."""
    from sluice.controller.resume import read_driver_state

    common = ["run.mode=async", "run.backend=local", "rollout.max_staleness=1", "rollout.max_batch=16"]
    common += ["trainer.ppo_epochs=4"]  # a slower trainer lets groups wait in the queue at the cut
    # The whole 5-step run first, then a resume from its step-2 checkpoint: admission stops at the
    # run's budget, so a run of only 2 steps would have nothing open at its final checkpoint.
    common += ["run.steps=5", "run.checkpoint_every=2", "run.keep_checkpoints=2"]
    _fit(tiny_task_model, tmp_path, "cut", *common)
    step2 = tmp_path / "cut" / "checkpoints" / "step_000002"
    cut = read_driver_state(step2).cut
    resumed = _fit(tiny_task_model, tmp_path, "cut", *common, f"run.resume={step2}")
    ids, steps = trained_ids(resumed.run_dir)
    assert steps == [1, 2, 3, 4, 5]
    assert set(ids.values()) == {1} and len(ids) == 5 * 4 * 4
    groups = {int(uid.split("-")[0]) for uid in ids}
    open_at_cut = set(cut.reports) | {gid for _, gid in cut.regenerate}
    assert len(open_at_cut) >= 4 and open_at_cut <= groups  # B groups at least were past the gate
    rows = {i for i, group in enumerate(cut.queue["storage"]["meta"]) if group[1] in cut.reports}
    assert len(rows) == 4 * len(cut.reports)  # every written group's rows are in the snapshot
    fates = next(r for r in _records(resumed.run_dir) if r["kind"] == "fates")
    assert fates["groups_trained"] == 20
    assert fates.get("regenerated_restart_groups", 0) == len(cut.regenerate)


def _steps_logged(run_dir):
    """Complete lines of ``trained_ids.jsonl`` so far (one per trained step)."""
    path = run_dir / "trained_ids.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def _wait_for(predicate, what, timeout=900.0):  # generous: a loaded 2-core box is slow to start Ray workers
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "ranks",  # a SIGKILLed driver: the faults tier's kind of case (and make test's longest, 36 s)
    [pytest.param("single", marks=pytest.mark.faults), pytest.param("fsdp2", marks=pytest.mark.scale)],
)
def test_sigkill_mid_step_then_resume_auto_trains_each_sample_once(tiny_task_model, tmp_path, ray_cluster, ranks):
    """Ray async pipeline, η = 0: the driver's process group is SIGKILLed at a random point after
    the step-2 checkpoint (Ray then kills its rollout and trainer actors, requests in flight);
    ``resume=auto`` finishes the run. Every sample is trained exactly once, as uninterrupted.
    ``fsdp2``: two trainer ranks, each writing its shard of the checkpoint (DCP) and reading it back."""
    address = ray_cluster.get_runtime_context().gcs_address
    steps = 8  # room after the kill point, however fast the machine trains a step
    run = _run(tiny_task_model, tmp_path, "killed", "run.mode=async", "rollout.max_staleness=0", f"run.steps={steps}")
    run += ["run.backend=ray", f"run.ray_address={address}"]
    if ranks == "fsdp2":
        run += ["resources.trainer.ranks=2", "trainer.strategy=fsdp2", "trainer.lr_schedule=cosine"]
    run_dir = tmp_path / "killed"
    driver = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "train", *run, "run.checkpoint_every=2", "run.keep_checkpoints=1"],
        start_new_session=True,  # its own process group: the kill takes every process it started
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        kill_after = random.randint(2, 4)  # a random step after the step-2 checkpoint, then a random point in it
        _wait_for(lambda: (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file() or driver.poll() is not None,
                  "the step-2 checkpoint")  # fmt: skip
        _wait_for(lambda: _steps_logged(run_dir) >= kill_after or driver.poll() is not None, f"step {kill_after}")
        time.sleep(random.uniform(0.0, 0.05))
        assert driver.poll() is None, f"the run ended before the kill: {driver.stderr.read().decode()[-2000:]}"
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    killed_at = trained_ids(run_dir)[1]
    assert 2 <= len(killed_at) < steps, killed_at
    cfg = load_config(None, [*run, "run.resume=auto"])
    RLTrainer(cfg).fit()
    if ranks == "fsdp2":
        assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step_*/trainer/dcp/*.distcp"))
    one_rank = ["resources.trainer.ranks=1", "trainer.strategy=single"]  # the same samples in one process
    whole_cfg = load_config(None, [*run, "run.name=whole", "run.backend=local", *one_rank])
    RLTrainer(whole_cfg).fit()
    ids, logged = trained_ids(run_dir)
    assert logged == list(range(1, steps + 1))
    assert ids == trained_ids(tmp_path / "whole")[0] and set(ids.values()) == {1}
