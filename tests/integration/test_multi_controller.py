"""``run.controller: multi`` on a tiny real model and real Ray: rollout workers admit their own
groups from their own prompt shards, trainer ranks read their own shards of each step.

Every admitted sample is trained exactly once or discarded by a named filter, no trained group is
more than η versions stale, and each trainer rank gets its rows of the step exactly once, whatever
the rollout workers' and ranks' counts (2 → 1 here; 4 → 1 and 2 → 3 in ``make test-scale``).
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
    records, trained = _fit(tiny_task_model, tmp_path, "multi2", "resources.rollout.workers=2")
    _check_books(records, trained, workers=2)
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
