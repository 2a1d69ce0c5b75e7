"""DAG files: schema and graph errors that name the node, built-in DAGs, the planner's stages and
colocated serialisation (DistFlow §4.2), ``sluice plan-dag`` and the run's DAG checks."""

from __future__ import annotations

import copy
import random
import re
import sys

import pytest
from distflow.data_nodes import SYNTHETIC_GENERATE, TOKEN_CHECKSUM

from sluice.cli import main
from sluice.config import ConfigError, load_config
from sluice.dag import BUILTIN_DAGS, DagError, compile_dag, load_dag, parse_dag
from sluice.dag.run_dag import default_dag, place_dag, plan_for_run

SAMPLE = ["uid", "prompt_ids", "response_ids", "behav_logprobs", "token_versions", "loss_mask", "reward", "meta"]


def _dag() -> dict:
    """rollout -> (reference, values) -> score -> train, all valid."""
    return {
        "name": "t",
        "nodes": [
            {"id": "rollout", "role": "rollout", "type": "generate", "reads": ["prompt"], "writes": ["tokens"],
             "function": SYNTHETIC_GENERATE},
            {"id": "reference", "role": "reference", "type": "model_inference", "reads": ["tokens"],
             "writes": ["ref"], "function": TOKEN_CHECKSUM},
            {"id": "values", "role": "critic", "type": "model_inference", "reads": ["tokens"],
             "writes": ["values"], "function": TOKEN_CHECKSUM},
            {"id": "score", "role": "custom", "type": "compute", "reads": ["ref", "values"], "writes": ["score"],
             "function": "weighted_sum"},
            {"id": "train", "role": "actor", "type": "model_train", "reads": ["tokens", "score"],
             "function": TOKEN_CHECKSUM},
        ],
    }  # fmt: skip


def _error(raw: dict) -> str:
    with pytest.raises(DagError) as err:
        compile_dag(parse_dag(raw, "t.yaml"))
    return str(err.value)


def test_builtin_dags_load_and_compile():
    for name in BUILTIN_DAGS:
        plan = compile_dag(load_dag(name))
        assert plan.spec.name == name and plan.order()[0] == "rollout"
    assert [n.function for n in load_dag("grpo").nodes] == ["rollout", "group_advantages", "actor_update"]


def test_a_cycle_names_a_node_on_it():
    raw = _dag()
    raw["nodes"][1]["reads"] = ["tokens", "score"]  # reference <- score <- reference
    assert _error(raw) == "node 'reference' is on a cycle: reference -> score -> reference"


def test_a_column_nobody_writes_names_the_reader():
    raw = _dag()
    raw["nodes"][3]["reads"] = ["ref", "bonus"]
    assert _error(raw) == "node 'score' reads column 'bonus', which no node writes"


def test_two_producers_of_a_column_name_both():
    raw = _dag()
    raw["nodes"][2]["writes"] = ["ref"]
    assert _error(raw) == "column 'ref' is written by two nodes: 'reference' and 'values'"


def test_unknown_function_names_the_node_and_import_paths_resolve():
    raw = _dag()
    raw["nodes"][3]["function"] = "no_such_function"
    assert "node 'score': unknown function 'no_such_function'" in _error(raw)
    raw["nodes"][3]["function"] = "sluice.nowhere:fn"
    assert "node 'score': function 'sluice.nowhere:fn': cannot import" in _error(raw)
    raw["nodes"][3]["function"] = "sluice.dag.compute_nodes:nothing"
    assert "node 'score': unknown function" in _error(raw)
    raw["nodes"][3]["function"] = "sluice.dag.compute_nodes:weighted_sum"  # an import path is fine
    compile_dag(parse_dag(raw))


def test_schema_errors_name_the_node_and_field():
    raw = _dag()
    raw["nodes"][2]["parallelism"] = 2
    assert "node 'values' field parallelism" in _error(raw)
    raw = _dag()
    raw["nodes"][2]["type"] = "inference"
    assert "node 'values' field type" in _error(raw)
    raw = _dag()
    raw["nodes"][4]["id"] = "rollout"
    assert "node 'rollout': two nodes have this id" in _error(raw)


def test_shape_errors_name_the_node():
    raw = _dag()
    raw["nodes"][3]["writes"] = []
    assert _error(raw) == "node 'score' writes no column (only model_train nodes may)"
    raw = _dag()
    raw["nodes"][0]["reads"] = []
    assert "node 'rollout': a generate node reads the DAG inputs" in _error(raw)
    raw = _dag()
    raw["nodes"][4]["depends_on"] = ["ghost"]
    assert _error(raw) == "node 'train' depends_on unknown node 'ghost'"
    raw = _dag()
    raw["nodes"][3]["reads"] = ["ref", "score"]
    assert _error(raw) == "node 'score' depends on itself (it reads a column it writes)"


def test_load_dag_names_a_missing_file(tmp_path):
    with pytest.raises(DagError, match="does not exist"):
        load_dag(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("- just\n- a list\n")
    with pytest.raises(DagError, match=re.escape("bad.yaml: a DAG file is a mapping")):
        load_dag(tmp_path / "bad.yaml")


def test_colocated_plan_serialises_a_pool_by_depth():
    plan = compile_dag(load_dag("ppo_kl"), "colocated")
    # reference and critic values share depth 1 and the train pool: reference (first in the file) runs first
    assert plan.stages == (("rollout",), ("reference",), ("values",), ("gae",), ("train",), ("critic_train",))
    assert plan.added_edges == (("reference", "values"), ("train", "critic_train"))
    values_group = next(g for g in plan.groups if "values" in g.nodes)
    assert values_group.nodes == ("reference", "values", "gae", "train", "critic_train")
    disaggregated = compile_dag(load_dag("ppo_kl"), "disaggregated")
    assert disaggregated.stages[1] == ("reference", "values") and disaggregated.added_edges == ()
    assert len(disaggregated.groups) == 6


def test_colocated_plans_never_put_two_nodes_of_a_pool_in_one_stage():
    rng = random.Random(0)
    for trial in range(30):
        raw = _dag()
        for node in raw["nodes"]:
            node["resources"] = {"pool": rng.choice(["a", "b"])}
            node["parallel"] = rng.randint(1, 3)
        plan = compile_dag(parse_dag(copy.deepcopy(raw)), "colocated")
        position = {n: k for k, stage in enumerate(plan.stages) for n in stage}
        for stage in plan.stages:
            pools = [plan.spec.node(n).resources.pool for n in stage]
            assert len(pools) == len(set(pools)), (trial, plan.stages)
        for node, parents in plan.graph.parents.items():
            assert all(position[p] < position[node] for p in parents)
        for group in plan.groups:
            assert group.size == max(plan.spec.node(n).parallel for n in group.nodes)


def test_plan_dag_command_prints_stages_and_placement(capsys):
    assert main(["plan-dag", "ppo_kl"]) == 0
    out = capsys.readouterr().out
    assert "stages:" in out and "1: reference" in out and "serialised by the planner: reference -> values" in out
    assert main(["plan-dag", "grpo", "--placement", "disaggregated"]) == 0
    assert "advantages [pool train] ×1" in capsys.readouterr().out
    assert main(["plan-dag", "missing.yaml"]) == 2


def test_the_run_dag_follows_the_algorithm_and_must_agree_with_it():
    assert default_dag(load_config(None, [])) == "grpo"
    assert default_dag(load_config(None, ["trainer.kl_coef=0.01"])) == "grpo_kl"
    assert default_dag(load_config(None, ["trainer.algorithm=ppo", "run.mode=sync"])) == "ppo"
    with pytest.raises(ConfigError, match=re.escape("run.dag: DAG 'grpo' and trainer.algorithm 'ppo' disagree")):
        plan_for_run(load_config(None, ["trainer.algorithm=ppo", "run.mode=sync", "run.dag=grpo"]))
    with pytest.raises(ConfigError, match=re.escape("lacks a reference_logprobs node but trainer.kl_coef is 0.1")):
        plan_for_run(load_config(None, ["trainer.kl_coef=0.1", "run.dag=grpo"]))
    with pytest.raises(ConfigError, match=re.escape("run.dag: DAG file nowhere.yaml does not exist")):
        plan_for_run(load_config(None, ["run.dag=nowhere.yaml"]))


def test_the_dag_placement_gives_each_node_after_rollout_a_task_and_the_trainer_the_rest():
    from sluice.queue.samples import train_columns

    for name, with_reference in (("grpo", False), ("grpo_kl", True)):
        placed = place_dag(compile_dag(load_dag(name)), "train")
        want = {"train": train_columns(with_reference)}
        if with_reference:
            want["reference"] = tuple(SAMPLE)
        assert placed.tasks == want and placed.reward_column is None
        assert [n.function for n in placed.node_workers] == (["reference_logprobs"] if with_reference else [])
    # PPO: the critic's values are a task of their own (whatever the pool), the trainer reads them
    for name, with_reference in (("ppo", False), ("ppo_kl", True)):
        tasks = dict(place_dag(compile_dag(load_dag(name)), "train").tasks)
        assert tasks.pop("values") == tuple(SAMPLE)
        assert tasks.pop("reference", None) == (tuple(SAMPLE) if with_reference else None)
        assert set(tasks.pop("train")) == {*train_columns(with_reference), "values"} and not tasks
    # a user DAG: each compute node is a task; the trainer waits for the combined reward it reads
    placed = place_dag(compile_dag(load_dag("examples/dag_two_rewards/dag.yaml")), "train")
    assert [n.id for n in placed.node_workers] == ["length_penalty", "total_reward"]
    assert placed.tasks["total_reward"] == ("reward", "length_penalty")
    assert "total_reward" in placed.tasks["train"] and placed.reward_column == "total_reward"


def test_a_function_file_that_defines_a_dataclass_resolves(tmp_path):
    """The file's module is registered before it runs: a dataclass with string annotations looks
    its module up while the file executes (the data-path benchmark's ``data_nodes.py`` is such a
    file)."""
    from sluice.dag.functions import resolve_function
    from sluice.dag.spec import DagNode

    file = tmp_path / "nodes.py"
    file.write_text(
        "from __future__ import annotations\n\nfrom dataclasses import dataclass\n\n"
        "@dataclass(frozen=True)\nclass Cfg:\n    n: int = 2\n\n"
        "def double(ctx, rows):\n    return {'y': [Cfg().n * x for x in rows.columns['x']]}\n"
    )
    node = DagNode(id="d", role="custom", type="compute", reads=("x",), writes=("y",), function=f"{file}:double")
    assert resolve_function(node).__name__ == "double"
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RuntimeError, match="boom"):
        resolve_function(DagNode(id="b", role="custom", type="compute", reads=("x",), writes=("y",),
                                 function=f"{broken}:f"))  # fmt: skip
    assert not [m for m in sys.modules if m.startswith("sluice_dag_broken_")]  # no half-run module left behind
