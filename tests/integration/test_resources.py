"""The ``resources`` section drives Ray placement end to end: 2 rollout replicas and 2 ddp trainer
ranks train in ``colocated`` and in ``disaggregated`` placement (the placement groups Ray was
asked for are checked in its table), and on a two-node local cluster the node labels put the
rollout (and its replica actors) and the trainer ranks on the nodes the config names.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1]


def _trains(records: list[dict]) -> None:
    """Two steps trained, and the engines hold the trainer's weights."""
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    weights = next(r for r in records if r["kind"] == "weights")
    assert weights["engine_version"] == weights["trainer_version"] == 2
    assert weights["engine_checksum"] == weights["trainer_checksum"]


GROUPS = {"colocated": [("PACK", 3)], "disaggregated": [("PACK", 1), ("PACK", 2)]}
"""The placement groups each placement asks Ray for: (strategy, bundles)."""


# Both in the scale tier: two replicas, two DDP ranks, the queue's actors and the registry (the
# rollout worker and each rank import torch and transformers, ≈ 7 CPU-s each): 20–25 s on 2
# cores. ``make test`` keeps a Ray run of two DDP ranks in the default (colocated) placement,
# ``test_async_pipeline.py::test_two_data_parallel_ranks_give_one_process_update[one-ddp]``,
# and the placement groups' arithmetic (``tests/unit/test_pipeline_placement.py``).
@pytest.mark.parametrize("placement", [pytest.param(p, marks=pytest.mark.scale) for p in GROUPS])
def test_resources_place_two_replicas_and_two_ranks(tiny_task_model, tmp_path, ray_cluster, placement):
    from ray.util import placement_group_table

    before = set(placement_group_table())
    run = [*tiny_run_overrides(tiny_task_model, tmp_path, placement), "run.backend=ray", "run.steps=2"]
    run += ["run.mode=async", "rollout.max_new_tokens=8", "run.eval_every=0", "trainer.strategy=ddp"]
    run += ["resources.rollout.replicas=2", "resources.trainer.ranks=2", f"resources.placement={placement}"]
    result = RLTrainer(load_config(None, run), reward=length_reward).fit()
    _trains([json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()])
    made = [g for pg, g in placement_group_table().items() if pg not in before]
    assert sorted((g["strategy"], len(g["bundles"])) for g in made) == GROUPS[placement]
    assert all(g["state"] == "REMOVED" for g in made)  # freed with the run


@pytest.mark.scale
def test_node_labels_place_rollout_and_trainer_on_the_nodes_they_name(tiny_task_model, tmp_path):
    """Its own process: a two-node ``Cluster`` cannot share this session's Ray instance."""
    paths = [str(TESTS), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    script = TESTS / "integration" / "two_node_run.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_task_model), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["head"] != report["labelled"]
    assert report["rollout"] == report["labelled"]  # resources.rollout.node_resource: rollout_node
    assert report["replicas"] == [report["labelled"]] * 2  # replica actors share the rollout's bundle
    assert report["trainers"] == [report["head"]] * 2  # resources.trainer.node_resource: trainer_node
    _trains(report["metrics"])
