"""Resource planner: the split of devices between generation and training, the devices per
rollout replica and the trainer's micro-batch budget that give the shortest simulated step (or
the most samples per dollar), before a run is launched.

``plan(workload, cluster)`` enumerates every candidate (rollout devices + train devices = the
cluster's devices, replica sizes dividing the rollout devices, micro-batch budgets that fit in
memory), orders them by an analytic lower bound of their step time (expected decode work at the
best batch per token, trainer FLOPs), and runs the full pipeline simulation (``sim.simulate``)
on them in that order until the next bound cannot beat the best simulated result (branch and
bound: most candidates are never simulated). Candidates are ranked by the simulation.

It does not move replicas while a run goes (``fleet.rebalance`` does,
``schedule/rebalance.py``) or measure hardware (``sim.cost_model`` presets, ``benchmarks/harness/fit.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal

from sluice.schedule.step_model import step_time_s
from sluice.sim.cost_model import CostModel, DeviceSpec, Efficiency, ModelShape, trainer_cost
from sluice.sim.engine import LengthModel
from sluice.sim.simulate import Mode, SimConfig, SimResult, simulate

Objective = Literal["step", "cost"]
BOUND_SLACK = 0.8
"""The analytic bound uses expected lengths; a batch's draw can be shorter, so it is loosened."""


@dataclass(frozen=True)
class Workload:
    """What is trained: model, batch, lengths and the pipeline's mode."""

    model: ModelShape
    prompts_per_step: int = 32
    group_size: int = 8
    prompt_len: int = 256
    lengths: LengthModel = field(default_factory=lambda: LengthModel(median=1000, prompt_sigma=0.6, sample_sigma=0.6))
    max_new_tokens: int = 8192
    mode: Mode = "async"
    eta: int = 1
    weight_update: Literal["interrupt", "defer", "staggered"] = "interrupt"
    reward_latency_s: float = 0.0
    extra_forwards: int = 1
    """Forward passes per trained token besides forward + backward (proximal / ref log-probs)."""


@dataclass(frozen=True)
class Cluster:
    """Devices to split: ``devices`` in all; generation on ``rollout_device``, training on
    ``train_device`` (the same kind unless planning a heterogeneous pair)."""

    rollout_device: DeviceSpec
    devices: int
    train_device: DeviceSpec | None = None
    rollout_eff: Efficiency = field(default_factory=Efficiency)
    train_eff: Efficiency = field(default_factory=Efficiency)
    replica_sizes: tuple[int, ...] = (1, 2, 4, 8)
    micro_batch_tokens: tuple[int, ...] = (4096, 16384, 65536)

    @property
    def trainer_device(self) -> DeviceSpec:
        return self.train_device or self.rollout_device


@dataclass(frozen=True)
class Candidate:
    rollout_devices: int
    train_devices: int
    replica_devices: int
    micro_batch_tokens: int

    @property
    def replicas(self) -> int:
        return self.rollout_devices // self.replica_devices

    def label(self) -> str:
        return (
            f"rollout {self.rollout_devices} ({self.replicas} x {self.replica_devices}), "
            f"train {self.train_devices}, micro-batch {self.micro_batch_tokens}"
        )


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    result: SimResult
    cost_per_hour: float

    @property
    def samples_per_dollar(self) -> float:
        return self.result.samples_per_s * 3600.0 / self.cost_per_hour


@dataclass(frozen=True)
class Plan:
    ranked: list[Ranked]
    """Simulated candidates, best first."""
    enumerated: int
    skipped: list[tuple[Candidate, str]] = field(default_factory=list)
    """Candidates that cannot run (model or micro-batch does not fit), with the reason."""


def candidates(workload: Workload, cluster: Cluster) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """Every split the cluster allows, and those refused with the reason."""
    ok: list[Candidate] = []
    refused: list[tuple[Candidate, str]] = []
    for rollout in range(1, cluster.devices):
        for size in cluster.replica_sizes:
            if rollout % size:
                continue
            for budget in cluster.micro_batch_tokens:
                cand = Candidate(rollout, cluster.devices - rollout, size, budget)
                try:
                    sim_config(workload, cluster, cand)
                except ValueError as err:
                    refused.append((cand, str(err)))
                    continue
                ok.append(cand)
    return ok, refused


DEVICES_PER_NODE = 8
"""Accelerators per node, for the plan's storage units: one TransferQueue unit per node."""


def run_keys(workload: Workload, cluster: Cluster, cand: Candidate) -> dict[str, Any]:
    """The config keys of ``sluice train`` that run ``cand`` on ``workload`` (a mapping of
    sections, as a config file holds them): the split (``resources``), the batch and lengths
    (``rollout``), the micro-batch budget and the sharded ranks (``trainer``), the schedule
    (``run.mode``). Rollout and training get devices of their own, so placement is disaggregated;
    on accelerators each replica is a Ray actor on ``replica_devices`` GPUs (vLLM's tensor
    parallelism over them), each trainer rank has one, and the queue has a storage unit per node
    of ``DEVICES_PER_NODE``; on ``cpu`` a device is a core (torch threads)."""
    rollout: dict[str, Any] = {
        "prompts_per_step": workload.prompts_per_step,
        "group_size": workload.group_size,
        "max_new_tokens": workload.max_new_tokens,
        "weight_update": workload.weight_update,
    }
    if workload.mode == "async":
        rollout["max_staleness"] = workload.eta
    trainer: dict[str, Any] = {"micro_batch_tokens": cand.micro_batch_tokens}
    if cand.train_devices > 1:
        trainer["strategy"] = "fsdp2"
    keys: dict[str, Any] = {
        "run": {"mode": workload.mode},
        "rollout": rollout,
        "trainer": trainer,
        "resources": {"placement": "disaggregated"},
    }
    fleet, bounds = rebalance_keys(workload, cand)
    if fleet:
        keys["fleet"] = fleet
    if cluster.rollout_device.name == "cpu":
        rollout_res: dict[str, Any] = {"replicas": cand.replicas, "threads": cand.replica_devices, **bounds}
        if cand.replicas > 1:
            rollout_res["replica_actors"] = True
        keys["resources"]["rollout"] = rollout_res
        keys["resources"]["trainer"] = {"ranks": cand.train_devices, "threads": 1}
        return keys
    keys["resources"]["rollout"] = {
        "replicas": cand.replicas, "replica_actors": True, "gpus": float(cand.replica_devices), **bounds,
    }  # fmt: skip
    keys["resources"]["trainer"] = {"ranks": cand.train_devices, "gpus": 1.0}
    keys["queue"] = {"storage_units": math.ceil((cand.rollout_devices + cand.train_devices) / DEVICES_PER_NODE)}
    if cand.replica_devices > 1:
        keys["vllm"] = {"tensor_parallel_size": cand.replica_devices}
    return keys


def rebalance_keys(workload: Workload, cand: Candidate) -> tuple[dict[str, Any], dict[str, int]]:
    """``fleet.rebalance*`` and the replica bounds for ``cand``: the rollout's devices hold
    ``cand.replicas`` at most, so the run starts there and the rule (which predicts with this
    planner's step model) may shed replicas down to one while the trainer waits for nothing, and
    take them back while generation lags. A step alternates long and short when generation
    overlaps training, so decisions average 2 steps (1 in sync); after a change the rule waits
    η + 1 steps, within which the groups admitted before it are trained. One replica: nothing
    to rebalance, no keys."""
    if cand.replicas == 1:
        return {}, {}
    staleness = {"sync": 0, "streaming": 0, "one_step": 1}.get(workload.mode, workload.eta)
    window = 1 if workload.mode == "sync" else 2
    fleet = {"rebalance": True, "rebalance_window": window, "rebalance_cooldown": max(window, staleness + 1)}
    return fleet, {"min_replicas": 1, "max_replicas": cand.replicas}


def sim_config(workload: Workload, cluster: Cluster, cand: Candidate, steps: int = 5) -> SimConfig:
    """The simulation of ``cand`` (raises ``ValueError`` when it cannot run)."""
    gen = CostModel(workload.model, cluster.rollout_device, cluster.rollout_eff)
    train = CostModel(workload.model, cluster.trainer_device, cluster.train_eff)
    return SimConfig(
        engine=gen.engine_config(cand.replica_devices, workload.lengths, workload.prompt_len),
        trainer=trainer_cost(train, cand.train_devices, cand.micro_batch_tokens, workload.extra_forwards),
        replicas=cand.replicas,
        prompts_per_step=workload.prompts_per_step,
        group_size=workload.group_size,
        max_new_tokens=workload.max_new_tokens,
        prompt_len=workload.prompt_len,
        mode=workload.mode,
        eta=workload.eta,
        weight_update=workload.weight_update,
        reward_latency_s=workload.reward_latency_s,
        steps=steps,
    )


def lower_bound_s(config: SimConfig) -> float:
    """A step cannot be shorter than its expected decode work spread over the replicas at the
    cheapest batch per token, nor than the trainer's work (both, in sequence, when in sync);
    nor than 1 / (η + 1) of the time one decode iteration after another takes to reach a
    typical longest response of the batch (a group must be trained within η + 1 steps). The
    combination is ``schedule/step_model.py``'s, the model the run's rebalancing rule predicts with."""
    lengths, engine, trainer = config.engine.lengths, config.engine, config.trainer
    sigma = math.hypot(lengths.prompt_sigma, lengths.sample_sigma)
    mean_len = min(lengths.median * math.exp(0.5 * sigma**2), config.max_new_tokens)
    samples = config.prompts_per_step * config.group_size
    per_token = engine.iteration_s(engine.max_running) / engine.max_running
    generate = samples * mean_len * per_token / config.replicas
    tokens = samples * (mean_len + config.prompt_len)
    micro_batches = math.ceil(tokens / trainer.micro_batch_tokens)
    train = tokens * trainer.token_s + micro_batches * trainer.microbatch_overhead_s + trainer.step_s
    # The longest response among B prompts (fewer than B·n draws: lengths correlate in a prompt).
    z = NormalDist().inv_cdf(1.0 - 1.0 / (config.prompts_per_step + 1))
    longest = min(lengths.median * math.exp(sigma * z), config.max_new_tokens) * engine.decode_s
    if config.mode == "sync":
        return BOUND_SLACK * step_time_s(generate, train, longest, overlapped=False)
    return BOUND_SLACK * step_time_s(generate, train, longest / (config.staleness + 1), overlapped=True)


def cost_per_hour(cluster: Cluster, cand: Candidate) -> float:
    return (
        cand.rollout_devices * cluster.rollout_device.cost_per_hour
        + cand.train_devices * cluster.trainer_device.cost_per_hour
    )


def plan(workload: Workload, cluster: Cluster, objective: Objective = "step", steps: int = 5) -> Plan:
    """Branch and bound over ``candidates`` (see the module docstring)."""
    if objective not in ("step", "cost"):
        raise ValueError(f"objective must be 'step' or 'cost', got {objective!r}")
    ok, refused = candidates(workload, cluster)
    if not ok:
        raise ValueError(f"no configuration fits: {refused[0][1] if refused else 'no devices to split'}")
    samples = workload.prompts_per_step * workload.group_size

    def score_bound(cand: Candidate) -> float:  # lower is better, never above the true score
        bound = lower_bound_s(sim_config(workload, cluster, cand, steps))
        return bound if objective == "step" else -samples * 3600.0 / (bound * cost_per_hour(cluster, cand))

    ranked: list[Ranked] = []
    best = math.inf
    for bound, cand in sorted(((score_bound(c), c) for c in ok), key=lambda bc: bc[0]):
        if bound > best:
            break
        result = simulate(sim_config(workload, cluster, cand, steps))
        entry = Ranked(cand, result, cost_per_hour(cluster, cand))
        ranked.append(entry)
        best = min(best, _score(entry, objective))
    ranked.sort(key=lambda r: _score(r, objective))
    return Plan(ranked, len(ok), refused)


def _score(entry: Ranked, objective: Objective) -> float:
    return entry.result.step_s if objective == "step" else -entry.samples_per_dollar
