"""The planner's branch and bound finds the brute-force optimum of a small case (for both
objectives, and for a heterogeneous pair) while simulating fewer candidates."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluice.sim.cost_model import DEVICES, MODELS, Efficiency
from sluice.sim.engine import LengthModel
from sluice.sim.planner import (
    Cluster,
    Objective,
    Ranked,
    Workload,
    candidates,
    cost_per_hour,
    lower_bound_s,
    plan,
    sim_config,
)
from sluice.sim.simulate import simulate


def brute_force(workload: Workload, cluster: Cluster, objective: Objective = "step", steps: int = 5) -> list[Ranked]:
    """Every candidate simulated, best first: the oracle ``plan``'s branch and bound must agree with."""
    ok, _ = candidates(workload, cluster)
    entries = [Ranked(c, simulate(sim_config(workload, cluster, c, steps)), cost_per_hour(cluster, c)) for c in ok]
    return sorted(entries, key=lambda r: r.result.step_s if objective == "step" else -r.samples_per_dollar)


WORKLOAD = Workload(
    MODELS["qwen2.5-1.5b"], prompts_per_step=4, group_size=4, prompt_len=32,
    lengths=LengthModel(median=60, prompt_sigma=0.4, sample_sigma=0.4), max_new_tokens=400,
)  # fmt: skip
# Slow training (low MFU, costly micro-batches) so the split matters both ways.
CLUSTER = Cluster(DEVICES["A100"], 5, train_eff=Efficiency(train_flops=0.0005, microbatch_overhead_s=0.4),
                  replica_sizes=(1, 2), micro_batch_tokens=(256, 2048))  # fmt: skip


@pytest.mark.parametrize("objective", ["step", "cost"])
def test_plan_finds_the_brute_force_optimum(objective):
    cluster = replace(CLUSTER, train_device=DEVICES["H100"]) if objective == "cost" else CLUSTER
    best = brute_force(WORKLOAD, cluster, objective, steps=3)
    found = plan(WORKLOAD, cluster, objective, steps=3)
    assert found.enumerated == len(best)
    assert found.ranked[0].candidate == best[0].candidate
    assert len(found.ranked) < found.enumerated  # the bound pruned some simulations
    for entry in best:  # the bound is a bound
        assert lower_bound_s(sim_config(WORKLOAD, cluster, entry.candidate, steps=3)) <= entry.result.step_s


def test_plan_refuses_a_cluster_that_cannot_hold_the_model():
    with pytest.raises(ValueError, match="fits"):
        plan(Workload(MODELS["qwen2.5-32b"]), Cluster(DEVICES["910B"], 2, replica_sizes=(1,)))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_written_plan_is_config_that_train_takes(model, tmp_path, capsys):
    """``sluice plan --out plan.yaml`` for every model preset: ``sluice train my_run.yaml
    plan.yaml`` reads it, the split it printed first is the one it wrote, and the run's own
    keys stay where the plan has none."""
    import yaml

    from sluice.cli import main
    from sluice.config import load_config

    device, devices = ("cpu", 2) if model == "tiny" else ("H100", 8)
    out = tmp_path / "plan.yaml"
    args = ["plan", "--model", model, "--device", device, "--devices", str(devices), "--batch", "8",
            "--group-size", "4", "--max-new-tokens", "512", "--median-len", "100", "--steps", "2",
            "--replica-sizes", "1,2,4", "--micro-batch-tokens", "1024", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    best = capsys.readouterr().out.splitlines()[2].split()  # '# rollout replicas train micro-batch ...' row 1
    replicas, per_replica = (int(x) for x in best[2].split("x"))
    mine = tmp_path / "my_run.yaml"
    mine.write_text("run:\n  steps: 2\n  name: mine\nrollout:\n  temperature: 0.7\n  group_size: 2\n")
    cfg = load_config([mine, out], ["run.steps=3"])
    assert cfg.run.steps == 3 and cfg.run.name == "mine" and cfg.rollout.temperature == 0.7
    assert cfg.rollout.group_size == 4 and cfg.rollout.prompts_per_step == 8  # the plan's, over the run's
    assert cfg.resources.rollout.replicas == replicas and cfg.resources.trainer.ranks == int(best[3])
    assert cfg.trainer.micro_batch_tokens == int(best[4]) == 1024
    if device == "cpu":
        assert cfg.resources.rollout.threads == per_replica and cfg.resources.rollout.gpus is None
    else:
        assert cfg.resources.rollout.gpus == per_replica and cfg.resources.placement == "disaggregated"
        assert cfg.vllm.tensor_parallel_size == per_replica and cfg.queue.storage_units == 1  # 8 devices: a node
    assert yaml.safe_load(out.read_text())["rollout"]["max_staleness"] == 1
    # rebalancing within the rollout's devices, decisions over 2 steps, η + 1 = 2 steps between changes
    assert cfg.fleet.rebalance == (replicas > 1)
    if replicas > 1:
        assert (cfg.resources.rollout.min_replicas, cfg.resources.rollout.max_replicas) == (1, replicas)
        assert (cfg.fleet.rebalance_window, cfg.fleet.rebalance_cooldown) == (2, 2)


@pytest.mark.parametrize(("mode", "eta", "window", "cooldown"), [("async", 2, 2, 3), ("sync", 0, 1, 1)])
def test_a_plan_of_several_replicas_writes_the_rebalancing_keys(mode, eta, window, cooldown, tmp_path):
    """A split of 4 one-device replicas: the run may shed replicas down to 1 and take them back
    up to the 4 devices (``fleet.rebalance``), decided over ``window`` steps, ``cooldown`` = η + 1
    apart; the keys load as a run's config."""
    import yaml

    from sluice.config import load_config
    from sluice.sim.planner import Candidate, run_keys

    workload = replace(WORKLOAD, mode=mode, eta=eta)
    for device in ("H100", "cpu"):
        out = tmp_path / f"{device}.yaml"
        out.write_text(yaml.safe_dump(run_keys(workload, replace(CLUSTER, rollout_device=DEVICES[device]),
                                               Candidate(4, 1, 1, 2048))))  # fmt: skip
        cfg = load_config([out], [])
        assert cfg.fleet.rebalance and cfg.resources.rollout.replicas == 4
        assert (cfg.resources.rollout.min_replicas, cfg.resources.rollout.max_replicas) == (1, 4)
        assert (cfg.fleet.rebalance_window, cfg.fleet.rebalance_cooldown) == (window, cooldown)


def test_config_files_merge_section_by_section_in_order(tmp_path):
    from sluice.config.loading import merge_layers

    base = {"run": {"steps": 2, "name": "a"}, "rollout": {"group_size": 4}, "data": {"train": ["x.jsonl"]}}
    layer = {"run": {"steps": 5}, "data": {"train": ["y.jsonl"]}}
    assert merge_layers(base, layer) == {
        "run": {"steps": 5, "name": "a"}, "rollout": {"group_size": 4}, "data": {"train": ["y.jsonl"]},
    }  # fmt: skip
    assert base["run"] == {"steps": 2, "name": "a"}  # the layers themselves are left as they were
