"""Edges of a DAG, derived from its columns, and the checks that make it runnable.

``DagGraph.build(spec)`` finds each column's single producer, adds an edge from producer to
every reader (plus the ``depends_on`` edges), rejects what cannot run — a column read but never
written, a column written by two nodes, an unknown ``depends_on`` target, a cycle, an unknown
function, a node type the runtime cannot give rows to — each with one message naming the node,
and computes every node's depth (longest path from a source). Placement is ``planner.py``'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sluice.dag.functions import resolve_function
from sluice.dag.spec import DagError, DagNode, DagSpec


@dataclass(frozen=True)
class DagGraph:
    spec: DagSpec
    producer: Mapping[str, str]
    """column -> the node that writes it (DAG inputs have none)."""
    parents: Mapping[str, tuple[str, ...]]
    """node -> the nodes it must run after (column producers and ``depends_on``), sorted."""
    depth: Mapping[str, int]
    """node -> length of the longest path from a node without parents (sources have depth 0)."""

    @classmethod
    def build(cls, spec: DagSpec, *, check_functions: bool = True) -> DagGraph:
        producer = _producers(spec)
        parents: dict[str, set[str]] = {}
        ids = {n.id for n in spec.nodes}
        for node in spec.nodes:
            _check_node_shape(node, spec)
            deps = set()
            for column in node.reads:
                if column in producer:
                    deps.add(producer[column])
                elif column not in spec.inputs:
                    raise DagError(f"node {node.id!r} reads column {column!r}, which no node writes")
            for other in node.depends_on:
                if other not in ids:
                    raise DagError(f"node {node.id!r} depends_on unknown node {other!r}")
                deps.add(other)
            if node.id in deps:
                raise DagError(f"node {node.id!r} depends on itself (it reads a column it writes)")
            parents[node.id] = deps
            if check_functions:
                resolve_function(node)
        depth = longest_path_depths(parents)
        return cls(spec, producer, {k: tuple(sorted(v)) for k, v in parents.items()}, depth)

    def children(self, node_id: str) -> tuple[str, ...]:
        return tuple(sorted(n for n, ps in self.parents.items() if node_id in ps))

    def topological(self) -> list[DagNode]:
        """Nodes by (depth, order in the file): every node after all its parents."""
        order = {n.id: k for k, n in enumerate(self.spec.nodes)}
        return sorted(self.spec.nodes, key=lambda n: (self.depth[n.id], order[n.id]))


def _producers(spec: DagSpec) -> dict[str, str]:
    producer: dict[str, str] = {}
    for node in spec.nodes:
        for column in node.writes:
            if column in spec.inputs:
                raise DagError(f"node {node.id!r} writes {column!r}, which is a DAG input (the data loader's)")
            if column in producer:
                raise DagError(f"column {column!r} is written by two nodes: {producer[column]!r} and {node.id!r}")
            producer[column] = node.id
    return producer


def _check_node_shape(node: DagNode, spec: DagSpec) -> None:
    if not node.writes and node.type != "model_train":
        raise DagError(f"node {node.id!r} writes no column (only model_train nodes may)")
    reads_input = any(c in spec.inputs for c in node.reads)
    if node.type == "generate" and not reads_input:
        raise DagError(f"node {node.id!r}: a generate node reads the DAG inputs {list(spec.inputs)}")
    if node.type != "generate" and reads_input:
        raise DagError(f"node {node.id!r}: only generate nodes read the DAG inputs {list(spec.inputs)}")


def longest_path_depths(parents: Mapping[str, set[str]]) -> dict[str, int]:
    """Longest-path depth by Kahn's algorithm; a leftover node sits on a cycle."""
    remaining = {n: set(ps) for n, ps in parents.items()}
    depth: dict[str, int] = {}
    ready = sorted(n for n, ps in remaining.items() if not ps)
    while ready:
        node = ready.pop(0)
        depth[node] = max((depth[p] + 1 for p in parents[node]), default=0)
        del remaining[node]
        for other, ps in remaining.items():
            ps.discard(node)
            if not ps and other not in ready and other not in depth:
                ready.append(other)
        ready.sort()
    if remaining:
        cycle = _one_cycle({n: parents[n] for n in remaining})
        raise DagError(f"node {cycle[0]!r} is on a cycle: {' -> '.join(cycle)}")
    return depth


def _one_cycle(parents: Mapping[str, set[str]]) -> list[str]:
    """A cycle among ``parents`` (every node here has a parent here), as a closed path."""

    def step(n: str) -> str:
        return min(p for p in parents[n] if p in parents)

    path = [min(parents)]
    node = step(path[0])
    while node not in path:
        path.append(node)
        node = step(node)
    cycle = [*path[path.index(node) :], node]
    return list(reversed(cycle))
