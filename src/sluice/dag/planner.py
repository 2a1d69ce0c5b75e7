"""The DAG planner (DistFlow §4.2): a validated DAG compiled to stages and worker groups.

Two placements. **Disaggregated**: every node gets its own group of ``parallel`` workers (Ray
actors on the node's resources); nodes at the same depth run at the same time and stream
through the TransferQueue. **Colocated**: the nodes of one device pool share its workers, so
the planner serialises them — nodes of a pool are ordered by (depth, position in the file) and
each is made to depend on the previous one — which guarantees that at most one of the pool's
models is active at a time; each worker of the pool then owns that chain of node functions.
Stages are the depths after serialisation. Nothing here starts a worker (``runtime.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

from sluice.dag.graph import DagGraph, longest_path_depths
from sluice.dag.spec import DagSpec

Placement = Literal["colocated", "disaggregated"]
PLACEMENTS: tuple[Placement, ...] = ("colocated", "disaggregated")


@dataclass(frozen=True)
class WorkerGroup:
    """``size`` workers that each run ``nodes`` in this order, every step."""

    name: str
    pool: str
    size: int
    nodes: tuple[str, ...]
    cpus: float
    devices: float


@dataclass(frozen=True)
class Plan:
    graph: DagGraph
    placement: Placement
    stages: tuple[tuple[str, ...], ...]
    """Node ids by depth after serialisation; a stage's nodes may run at the same time."""
    groups: tuple[WorkerGroup, ...]
    added_edges: tuple[tuple[str, str], ...]
    """(before, after) orderings the planner added to serialise colocated nodes."""

    @property
    def spec(self) -> DagSpec:
        return self.graph.spec

    def order(self) -> list[str]:
        """Every node id, stage by stage (a valid serial execution order)."""
        return [n for stage in self.stages for n in stage]

    def queue_tasks(self) -> dict[str, tuple[str, ...]]:
        """TransferQueue tasks: every node that is not ``generate``, reading its ``reads``."""
        return {n.id: n.reads for n in self.spec.nodes if n.type != "generate"}

    def render(self) -> str:
        """The compiled plan as text (``sluice plan-dag``)."""
        spec = self.spec
        lines = [f"DAG {spec.name!r}: {len(spec.nodes)} nodes, placement {self.placement}", "stages:"]
        for k, stage in enumerate(self.stages):
            parts = []
            for node_id in stage:
                node = spec.node(node_id)
                parts.append(f"{node_id} ({node.role}/{node.type}, {node.function}, ×{node.parallel})")
            lines.append(f"  {k}: " + ", ".join(parts))
        lines.append("worker groups:")
        for g in self.groups:
            lines.append(
                f"  {g.name} [pool {g.pool}] ×{g.size} (cpus {g.cpus:g}, devices {g.devices:g}): {' -> '.join(g.nodes)}"
            )
        if self.added_edges:
            lines.append("serialised by the planner: " + ", ".join(f"{a} -> {b}" for a, b in self.added_edges))
        lines.append("edges (by column):")
        for node in spec.nodes:
            for parent in self.graph.parents[node.id]:
                shared = [c for c in node.reads if self.graph.producer.get(c) == parent]
                label = ", ".join(shared) if len(shared) <= 3 else f"{', '.join(shared[:2])}, … {len(shared)} columns"
                lines.append(f"  {parent} -> {node.id} [{label or 'depends_on'}]")
        return "\n".join(lines)


def compile_dag(spec: DagSpec, placement: Placement = "colocated", *, check_functions: bool = True) -> Plan:
    """Validate ``spec`` (``DagGraph.build``) and place it."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    graph = DagGraph.build(spec, check_functions=check_functions)
    if placement == "disaggregated":
        groups = tuple(_group(spec, n.id, n.resources.pool, (n.id,)) for n in graph.topological())
        return Plan(graph, placement, _stages(spec, graph.depth), groups, ())
    parents = {k: set(v) for k, v in graph.parents.items()}
    added: list[tuple[str, str]] = []
    pools: dict[str, list[str]] = {}
    for node in graph.topological():
        pools.setdefault(node.resources.pool, []).append(node.id)
    for chain in pools.values():
        for before, after in itertools.pairwise(chain):
            if before not in parents[after]:
                parents[after].add(before)
                added.append((before, after))
    depth = longest_path_depths(parents)
    groups = tuple(_group(spec, pool, pool, tuple(sorted(c, key=depth.__getitem__))) for pool, c in pools.items())
    return Plan(graph, placement, _stages(spec, depth), groups, tuple(added))


def _group(spec: DagSpec, name: str, pool: str, nodes: tuple[str, ...]) -> WorkerGroup:
    members = [spec.node(n) for n in nodes]
    return WorkerGroup(
        name=name,
        pool=pool,
        size=max(n.parallel for n in members),
        nodes=nodes,
        cpus=max(n.resources.cpus for n in members),
        devices=max(n.resources.devices for n in members),
    )


def _stages(spec: DagSpec, depth: dict[str, int]) -> tuple[tuple[str, ...], ...]:
    """Node ids grouped by depth, in file order inside a stage."""
    levels = max(depth.values()) + 1
    return tuple(tuple(n.id for n in spec.nodes if depth[n.id] == k) for k in range(levels))
