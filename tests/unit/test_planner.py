"""The planner's branch and bound finds the brute-force optimum of a small case (for both
objectives, and for a heterogeneous pair) while simulating fewer candidates."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluice.sim.cost_model import DEVICES, MODELS, Efficiency
from sluice.sim.engine import LengthModel
from sluice.sim.planner import Cluster, Workload, brute_force, lower_bound_s, plan, sim_config

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
