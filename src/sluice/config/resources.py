"""Config section ``resources``: where a run's workers run and what each may use: rollout replica
and trainer rank counts, threads, CPUs and GPUs per replica and per rank, node labels, and
whether rollout and trainer share nodes (``placement``). It is the one owner of these numbers;
``runtime/placement.py`` turns them into Ray placement groups. This module only declares and
validates; the table of the options it replaced lives in ``config/loading.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluice.config.section import Section as _Section


class RolloutResources(_Section):
    workers: int = Field(default=1, ge=1)
    """Rollout worker processes, each with its own engines and its own shard of the prompts
    (``run.controller: multi`` only; the single controller drives one)."""

    replicas: int = Field(default=1, ge=1)
    """Inference engine replicas behind the rollout worker's LLMProxy (least-outstanding-tokens
    routing). Without ``replica_actors`` they live in the rollout worker's process and share its
    ``threads``, so adding replicas never oversubscribes the cores (on CPU it adds no speed)."""

    min_replicas: int = Field(default=1, ge=1)
    """``fleet.rebalance``: the fewest replicas the rebalancer leaves (at most ``replicas``)."""

    max_replicas: int | None = Field(default=None, ge=1)
    """``fleet.rebalance``: the most replicas the rebalancer adds up to (at least ``replicas``;
    ``null``: ``replicas``, so it only removes). Each added replica is one more engine: with
    ``replica_actors`` one more actor (its own process, ``threads`` and, on accelerators, device),
    else one more engine in the rollout worker's process."""

    replica_actors: bool = False
    """Run each replica in its own Ray actor (its own process and ``threads`` torch threads)
    instead of inside the rollout worker's process; the LLMProxy drives them through Ray, and
    weights reach them through the object store after the rollout worker fetched them. Turn it on
    when there are devices or cores for each replica (on accelerators: one replica per device).
    The replica actors share the rollout worker's placement bundle, so they land on its node.
    ``run.backend: ray`` only."""

    threads: int = Field(default=1, ge=1)
    """torch threads of the rollout worker, and of each replica actor (decoding tiny models is
    overhead-bound: 1 is best)."""

    gpus: float | None = Field(default=None, ge=0.0)
    """GPUs per replica (Ray ``num_gpus``; fractions share a device). ``null``: one for the rollout
    when the cluster has any GPU, else none. A worker runs on CUDA exactly when Ray gave it a GPU."""

    cpus: float | None = Field(default=None, gt=0.0)
    """Ray CPUs the rollout worker reserves (placement bookkeeping; ``threads`` is what it runs).
    ``null``: an equal share of the cluster's CPUs, at most one, so every actor fits at once."""

    node_resource: str | None = None
    """A Ray custom resource that marks the nodes the rollout may run on (``ray start
    --resources='{"rollout_node": 1}'``); the rollout worker requests a thousandth of it, so it
    lands only on nodes that advertise it. ``null``: any node."""


class TrainerResources(_Section):
    ranks: int = Field(default=1, ge=1)
    """Trainer processes (ranks of ``torch.distributed``: gloo on CPU, NCCL on CUDA, chosen by
    where the tensors are). Each trains its share of a step's groups, dealt by tokens; gradients
    are summed once per optimizer update (each PPO mini-batch and epoch, under that mini-batch's
    normaliser over all ranks), so the update equals one process's up to float rounding. More
    than 1 needs ``run.backend: ray`` and ``trainer.strategy: ddp`` or ``fsdp2``."""

    threads: int = Field(default=1, ge=1)
    """torch threads of each trainer rank (and of the reference / critic-values workers). Threads
    summed over workers should not exceed the cores; above that, workers use OpenMP's passive wait
    so they yield cores to each other."""

    gpus: float | None = Field(default=None, ge=0.0)
    """GPUs per trainer rank (Ray ``num_gpus``). ``null``: one each when the cluster has a GPU for
    the rollout and every rank, else none (the trainer runs on CPU)."""

    cpus: float | None = Field(default=None, gt=0.0)
    """Ray CPUs each trainer rank reserves. ``null``: an equal share of the cluster's CPUs, at most
    one."""

    node_resource: str | None = None
    """A Ray custom resource that marks the nodes the trainer ranks may run on (as
    ``rollout.node_resource``). ``null``: any node."""


class RewardModelResources(_Section):
    workers: int = Field(default=1, ge=1)
    """Reward-model workers (``reward.model``), each a copy of the model scoring its own batches:
    objects in the rollout worker's process (``run.backend: local``) or a Ray actor each (``ray``)."""

    threads: int = Field(default=1, ge=1)
    """torch threads of each reward-model worker actor (``run.backend: ray``; a local run's workers
    share the rollout worker's)."""

    gpus: float | None = Field(default=None, ge=0.0)
    """GPUs per reward-model worker actor (Ray ``num_gpus``). ``null``: none (CPU)."""

    cpus: float | None = Field(default=None, gt=0.0)
    """Ray CPUs each reward-model worker actor reserves. ``null``: ``threads``."""


class ResourcesConfig(_Section):
    rollout: RolloutResources = RolloutResources()
    """The rollout worker and its engine replicas."""

    trainer: TrainerResources = TrainerResources()
    """The trainer ranks."""

    reward_model: RewardModelResources = RewardModelResources()
    """The reward model's workers (``reward.model``)."""

    placement: Literal["colocated", "disaggregated"] = "colocated"
    """How Ray places the rollout and trainer bundles (``run.backend: ray``): ``colocated`` (one
    placement group, ``PACK``: rollout and trainer on as few nodes as fit, sharing a node's
    devices) or ``disaggregated`` (a placement group per role, each packed on its own: with node
    labels, rollout and trainer on separate nodes)."""


def check_resources(resources: ResourcesConfig, backend: str, strategy: str) -> None:
    """Refuse resources the run's backend and trainer strategy cannot honour (one clear error)."""
    ranks = resources.trainer.ranks
    if ranks > 1 and backend != "ray":
        raise ValueError("resources.trainer.ranks > 1 needs run.backend: ray (one process per rank)")
    if ranks > 1 and strategy == "single":
        raise ValueError(
            f"resources.trainer.ranks={ranks} needs trainer.strategy: ddp or fsdp2 (single is one process)"
        )
    if resources.rollout.replica_actors and backend != "ray":
        raise ValueError("resources.rollout.replica_actors needs run.backend: ray")
    rollout = resources.rollout
    if not rollout.min_replicas <= rollout.replicas <= (rollout.max_replicas or rollout.replicas):
        raise ValueError(
            f"need resources.rollout.min_replicas ({rollout.min_replicas}) <= replicas ({rollout.replicas}) "
            f"<= max_replicas ({rollout.max_replicas})"
        )
