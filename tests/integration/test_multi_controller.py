"""``run.controller: multi`` on a tiny real model and real Ray: rollout workers admit their own
groups from their own prompt shards, trainer ranks read their own shards of each step.

Every admitted sample is trained exactly once or discarded by a named filter, no trained group is
more than η versions stale, and each trainer rank gets its rows of the step exactly once, whatever
the rollout workers' and ranks' counts (2 → 1 here; 4 → 1 and 2 → 3 in ``make test-scale``); a
SIGKILLed run resumes losslessly (``make test-faults``).
"""

import json
from collections import Counter

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration


def _fit(model_dir, out, name, *overrides):
    base = [
        *tiny_run_overrides(model_dir, out, name),
        "run.controller=multi",
        "run.backend=ray",
        "run.eval_every=0",
        "rollout.max_new_tokens=12",
        "rollout.max_staleness=1",
    ]
    cfg = load_config(None, [*base, *overrides])
    result = RLTrainer(cfg, reward=length_reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [json.loads(line) for line in (result.run_dir / "trained_ids.jsonl").read_text().splitlines()]
    return records, trained


def _one(records, kind):
    return next(r for r in records if r["kind"] == kind)


def _check_books(records, trained, workers, steps=3, groups=4, size=4, eta=1):
    """Every step trained B whole groups, each sample once, within η; the shards' cursors account
    for every admitted group; the engines hold the trainer's weights."""
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trains] == list(range(1, steps + 1))
    assert all(r["staleness_max"] <= eta for r in trains)
    ids = [uid for line in trained for uid in line["ids"]]
    assert [len(line["ids"]) for line in trained] == [groups * size] * steps
    assert len(ids) == len(set(ids)) == steps * groups * size  # each trained sample exactly once
    by_group = Counter(uid.rsplit("-", 1)[0] for uid in ids)
    assert set(by_group.values()) == {size}  # whole groups, however the ranks split them
    fates = _one(records, "fates")
    assert fates["groups_trained"] == steps * groups
    assert max(int(k.removeprefix("staleness_")) for k in fates if k.startswith("staleness_")) <= eta
    shards = _one(records, "shards")
    taken = sum(shards[f"shard{r}_position"] for r in range(workers))  # one epoch of 64 is enough here
    admitted = fates["groups_trained"] + fates.get("groups_discarded", 0)
    assert taken == admitted
    weights = _one(records, "weights")
    assert weights["engine_version"] == weights["trainer_version"] == steps
    assert weights["engine_checksum"] == weights["trainer_checksum"]
    return fates


def test_two_rollout_workers_feed_one_trainer_and_every_sample_trains_once(tiny_task_model, tmp_path, ray_cluster):
    records, trained = _fit(tiny_task_model, tmp_path, "multi2", "resources.rollout.workers=2", "run.steps=2")
    _check_books(records, trained, workers=2, steps=2)
    cpu = _one(records, "cpu")
    assert cpu["cpu_ShardRolloutWorker"] > 0 and cpu["cpu_StepGate"] >= 0
    assert _one(records, "driver")["sample_bytes"] == 0  # no prompt, no row passed the driver


@pytest.mark.scale
def test_four_rollout_workers_with_a_filter_keep_the_bound_and_the_fates(tiny_task_model, tmp_path, ray_cluster):
    records, trained = _fit(
        tiny_task_model, tmp_path, "multi4", "resources.rollout.workers=4", "rollout.filter_groups=zero_signal"
    )
    fates = _check_books(records, trained, workers=4)
    assert fates.get("groups_discarded", 0) == fates.get("discarded_zero_signal", 0) / 4  # named, counted


@pytest.mark.scale
def test_two_rollout_workers_feed_three_trainer_ranks_each_its_rows_once(tiny_task_model, tmp_path, ray_cluster):
    records, trained = _fit(
        tiny_task_model, tmp_path, "multi2to3", "resources.rollout.workers=2", "resources.trainer.ranks=3",
        "trainer.strategy=ddp",
    )  # fmt: skip
    _check_books(records, trained, workers=2)


@pytest.mark.scale
def test_a_reference_node_of_another_size_serves_its_shard_of_every_step(tiny_task_model, tmp_path, ray_cluster):
    """Two rollout workers, a reference node at parallel 3, one trainer: each reference rank reads
    its token-balanced shard of each step's partition (16 rows: 6 / 5 / 5), so every row gets its
    reference log-probs exactly once and the trainer's steps complete."""
    import yaml

    from sluice.dag.spec import builtin_dag_path

    dag = yaml.safe_load(builtin_dag_path("grpo_kl").read_text())
    next(n for n in dag["nodes"] if n["id"] == "reference")["parallel"] = 3
    path = tmp_path / "grpo_kl3.yaml"
    path.write_text(yaml.safe_dump(dag))
    records, trained = _fit(
        tiny_task_model, tmp_path, "ref3", "resources.rollout.workers=2", "trainer.kl_coef=0.05", f"run.dag={path}"
    )
    _check_books(records, trained, workers=2)
    shards = _one(records, "shards")
    assert sorted(shards[f"node_rows_reference{r}"] for r in range(3)) == [15, 15, 18]  # 3 steps of 5 / 5 / 6


@pytest.mark.faults
def test_sigkill_then_resume_trains_every_admitted_sample_once(tiny_task_model, tmp_path, ray_cluster):
    """Two rollout workers at η = 1: the driver's process group is SIGKILLed mid-run after the
    step-2 checkpoint; ``resume=auto`` finishes the run. Every step trains B whole groups, every
    sample once; the groups generating at the cut were restarted (counted), and the shards'
    cursors account for every admitted group: no prompt skipped, none taken twice."""
    import os
    import random
    import signal
    import subprocess
    import sys

    from test_resume import _run, _steps_logged, _wait_for, trained_ids

    address = ray_cluster.get_runtime_context().gcs_address
    steps = 8
    run = _run(tiny_task_model, tmp_path, "killed", "run.controller=multi", "resources.rollout.workers=2")
    run += ["run.backend=ray", f"run.ray_address={address}", "rollout.max_staleness=1", f"run.steps={steps}"]
    run += ["run.checkpoint_every=2", "run.keep_checkpoints=1", "run.eval_every=0"]
    run_dir = tmp_path / "killed"
    driver = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "train", *run],
        start_new_session=True,  # its own process group: the kill takes every process it started
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        kill_after = random.randint(2, 4)
        _wait_for(lambda: (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file() or driver.poll() is not None,
                  "the step-2 checkpoint")  # fmt: skip
        _wait_for(lambda: _steps_logged(run_dir) >= kill_after or driver.poll() is not None, f"step {kill_after}")
        assert driver.poll() is None, f"the run ended before the kill: {driver.stderr.read().decode()[-2000:]}"
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    assert 2 <= len(trained_ids(run_dir)[1]) < steps
    RLTrainer(load_config(None, [*run, "run.resume=auto"])).fit()
    ids, logged = trained_ids(run_dir)
    assert logged == list(range(1, steps + 1))
    assert set(ids.values()) == {1} and len(ids) == steps * 4 * 4  # each sample once, every step whole
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fates, shards = _one(records, "fates"), _one(records, "shards")
    assert fates["groups_trained"] == steps * 4
    assert shards["shard0_position"] + shards["shard1_position"] == fates["groups_trained"] + fates.get(
        "groups_discarded", 0
    )
    assert all(r["staleness_max"] <= 1 for r in records if r["kind"] == "train")
