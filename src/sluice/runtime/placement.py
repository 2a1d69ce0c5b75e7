"""Ray placement of the pipeline's rollout and trainer actors from the ``resources`` section.

``plan_placement`` is pure arithmetic: the bundles (CPUs, GPUs, node labels) of the rollout
worker and of each trainer rank, grouped into placement groups (``colocated``: one group,
``PACK``; ``disaggregated``: one group per role, each ``PACK``), and the options each actor is
started with. ``RayPlacement`` reserves those groups on the cluster, hands out each actor's
scheduling options, and finds addresses on a bundle's node (rendezvous ports are chosen on the
node that listens, at the IP Ray knows it by, never from the driver's hostname). It starts no
worker and decides nothing about what runs when.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.config.resources import ResourcesConfig

LABEL_SHARE = 0.001
"""How much of a node-label custom resource an actor requests: any node advertising the label
(``{"rollout_node": 1}``) fits a thousand of them."""

READY_TIMEOUT_S = 120.0
"""How long the placement groups may take to be placed before the run stops saying so."""


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: its placement group and bundle, and what it requests from it."""

    group: int
    bundle: int
    cpus: float
    gpus: float
    labels: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementPlan:
    groups: list[tuple[str, list[dict[str, float]]]]
    """(strategy, bundles) per placement group."""
    rollout: Slot
    replica_gpus: float
    """GPUs of each engine replica actor (``resources.rollout.replica_actors``; they share the
    rollout worker's bundle)."""
    trainers: list[Slot]


def gpu_share(cluster_gpus: float, replicas: int, ranks: int) -> tuple[float, float]:
    """(GPUs per rollout replica, GPUs per trainer rank) when the config leaves them ``null``: one
    each when the cluster has a GPU for every replica and rank, else one GPU for the whole rollout
    if there is any (shared by its replicas) and the trainer on CPU."""
    if cluster_gpus >= replicas + ranks:
        return 1.0, 1.0
    return (1.0 / replicas if cluster_gpus >= 1 else 0.0), 0.0


def actor_cpu_share(cluster_cpus: float, actors: int) -> float:
    """Ray CPUs per actor so that ``actors`` (rollout, every trainer rank, the reference and the
    critic's values worker) fit together: every actor must be placed at once (the ranks meet in a
    rendezvous, the trainer waits on the reference worker), so they share rather than queue."""
    return min(1.0, cluster_cpus / actors)


def plan_placement(resources: ResourcesConfig, cluster: Mapping[str, float], other_actors: int) -> PlacementPlan:
    """The placement groups and slots of the rollout worker and the trainer ranks on a cluster
    with ``cluster`` resources (``ray.cluster_resources()``); ``other_actors``: the node-task
    workers that take a CPU share outside the groups."""
    roll, train = resources.rollout, resources.trainer
    share = actor_cpu_share(cluster.get("CPU", 1.0), 1 + train.ranks + other_actors)
    auto_replica, auto_rank = gpu_share(cluster.get("GPU", 0.0), roll.replicas, train.ranks)
    per_replica = auto_replica if roll.gpus is None else roll.gpus
    per_rank = auto_rank if train.gpus is None else train.gpus
    rollout_labels = {roll.node_resource: LABEL_SHARE} if roll.node_resource else {}
    trainer_labels = {train.node_resource: LABEL_SHARE} if train.node_resource else {}
    rollout_bundle = _bundle(roll.cpus or share, per_replica * roll.replicas, rollout_labels)
    rank_bundle = _bundle(train.cpus or share, per_rank, trainer_labels)
    in_worker = 0.0 if roll.replica_actors else per_replica * roll.replicas
    if resources.placement == "colocated":
        groups = [("PACK", [rollout_bundle] + [rank_bundle] * train.ranks)]
        trainers = [Slot(0, 1 + r, train.cpus or share, per_rank, trainer_labels) for r in range(train.ranks)]
    else:
        groups = [("PACK", [rollout_bundle]), ("PACK", [rank_bundle] * train.ranks)]
        trainers = [Slot(1, r, train.cpus or share, per_rank, trainer_labels) for r in range(train.ranks)]
    rollout = Slot(0, 0, roll.cpus or share, in_worker, rollout_labels)
    return PlacementPlan(groups, rollout, per_replica if roll.replica_actors else 0.0, trainers)


def check_fits(plan: PlacementPlan, cluster: Mapping[str, float]) -> None:
    """Refuse at once, naming the resource and the ``resources`` keys that ask for it, a plan
    that needs more of a resource than the whole cluster has (GPUs on a CPU cluster, a node label
    no node advertises), instead of waiting for Ray to place what it never can."""
    need: dict[str, float] = {}
    for _, bundles in plan.groups:
        for bundle in bundles:
            for name, amount in bundle.items():
                need[name] = need.get(name, 0.0) + amount
    for name, amount in need.items():
        if amount > cluster.get(name, 0.0) + 1e-9:
            keys = {"CPU": "resources.*.cpus", "GPU": "resources.*.gpus"}.get(name, "resources.*.node_resource")
            raise RuntimeError(
                f"{keys}: the workers need {amount:g} {name} but the Ray cluster has "
                f"{cluster.get(name, 0.0):g} (ray.cluster_resources(): {dict(cluster)})"
            )


def _bundle(cpus: float, gpus: float, labels: Mapping[str, float]) -> dict[str, float]:
    """A bundle's resources (zero amounts left out: Ray refuses them)."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {}), **labels}
    return bundle


def node_address(node_id: str, nodes: Sequence[Mapping[str, Any]]) -> str:
    """The IP Ray reaches node ``node_id`` at (``ray.nodes()``'s ``NodeManagerAddress``), never its
    hostname."""
    for node in nodes:
        if node.get("NodeID") == node_id and node.get("Alive", True):
            return str(node["NodeManagerAddress"])
    raise RuntimeError(f"Ray node {node_id} is not among the cluster's live nodes")


def bundle_node(table: Mapping[str, Any], bundle: int) -> str:
    """The node id a placed group's bundle landed on (``ray.util.placement_group_table(pg)``)."""
    return str(table["bundles_to_node_id"][bundle])


class RayPlacement:
    """The plan's placement groups, reserved on the running Ray cluster (``close`` frees them)."""

    def __init__(self, plan: PlacementPlan, timeout_s: float = READY_TIMEOUT_S) -> None:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group

        check_fits(plan, ray.cluster_resources())
        self.plan = plan
        self.groups = [placement_group(bundles, strategy=strategy) for strategy, bundles in plan.groups]
        try:
            ray.get([g.ready() for g in self.groups], timeout=timeout_s)
        except GetTimeoutError:
            self.close()
            wanted = "; ".join(f"{s} {b}" for s, b in plan.groups)
            raise RuntimeError(
                f"resources: Ray could not place the workers in {timeout_s:.0f} s: they need {wanted}, "
                f"the cluster has {ray.cluster_resources()} (lower resources.*.gpus / cpus, or label "
                "nodes with the resources.*.node_resource names)"
            ) from None

    def options(self, slot: Slot) -> dict[str, Any]:
        """``actor.options(...)`` for an actor in ``slot``."""
        return {
            "num_cpus": slot.cpus,
            "num_gpus": slot.gpus,
            "resources": dict(slot.labels),
            "scheduling_strategy": self.strategy(slot),
        }

    def strategy(self, slot: Slot) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.groups[slot.group], placement_group_bundle_index=slot.bundle)

    def replica_options(self) -> dict[str, Any]:
        """Options of the engine replica actors: in the rollout worker's bundle, on its node."""
        return {"num_gpus": self.plan.replica_gpus, "scheduling_strategy": self.strategy(self.plan.rollout)}

    def node_of(self, slot: Slot) -> str:
        from ray.util import placement_group_table

        return bundle_node(placement_group_table(self.groups[slot.group]), slot.bundle)

    def free_address_on(self, slot: Slot) -> str:
        """A free ``tcp://ip:port`` on ``slot``'s node, chosen there (a zero-CPU task pinned to the
        node), at the node's IP as Ray knows it."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from sluice.trainer.rendezvous import free_tcp_address  # imports no torch: nor does the task's worker

        node = self.node_of(slot)
        host = node_address(node, ray.nodes())
        pinned = NodeAffinitySchedulingStrategy(node, soft=False)
        task: Any = ray.remote(num_cpus=0)(free_tcp_address).options(scheduling_strategy=pinned)
        return str(ray.get(task.remote(host)))

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)
        self.groups = []
