"""The DAG file: nodes that read and write TransferQueue columns (DistFlow §4.1), as pydantic models.

A DAG is a list of nodes; each node names its ``role`` (which model it belongs to), its ``type``
(what kind of computation), the columns it ``reads`` and ``writes``, the ``function`` it runs (a
built-in name or an import path) and its placement (``resources``, ``parallel``). Edges are not
written down: they follow from columns (``graph.py``). This module only declares the shape and
loads YAML; the graph checks (cycles, producers, functions) live in ``graph.py``, placement in
``planner.py``.
"""

from __future__ import annotations

from importlib import resources as package_files
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from sluice.config.section import Section

Role = Literal["actor", "critic", "reference", "reward", "rollout", "custom"]
NodeType = Literal["generate", "model_inference", "model_train", "compute"]

BUILTIN_DAGS = ("grpo", "grpo_kl", "ppo", "ppo_kl")
"""DAG files shipped in ``sluice/dag/builtin/``; ``run.dag`` names one of them or a path."""


class DagError(ValueError):
    """A DAG file that cannot run; the message names the file, node or column at fault."""


class NodeResources(Section):
    pool: str = "default"
    """Device pool the node's workers run on. Nodes in one pool share its devices (colocated:
    the planner serialises them by depth); nodes in different pools run at the same time on
    their own devices (disaggregated) and stream through the TransferQueue."""

    devices: float = Field(default=0.0, ge=0.0)
    """Accelerators per worker (Ray ``num_gpus``); 0 on CPU-only machines."""

    cpus: float = Field(default=1.0, ge=0.0)
    """CPUs per worker (Ray ``num_cpus``, scaled down to fit when the cluster is smaller)."""


class DagNode(Section):
    id: str = Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Unique node name; it is also the node's TransferQueue task."""

    role: Role
    """Whose model the node uses: ``actor``, ``critic``, ``reference``, ``reward``, ``rollout``
    or ``custom`` (no model)."""

    type: NodeType
    """``generate`` (creates rows from prompts), ``model_inference``, ``model_train`` or
    ``compute`` (plain Python over columns)."""

    reads: tuple[str, ...] = ()
    """Columns the node needs; each must be written by exactly one other node, or be one of the
    DAG's ``inputs`` (what the data loader provides)."""

    writes: tuple[str, ...] = ()
    """Columns the node produces (at least one, except for ``model_train`` nodes, whose output
    is the model itself)."""

    depends_on: tuple[str, ...] = ()
    """Extra ordering edges to other node ids, beyond those the columns imply."""

    function: str
    """What the node runs: a built-in name (``sluice.dag.functions.NODE_FUNCTIONS``), an
    import path ``package.module:name`` or a file ``path/to/file.py:name`` (relative to the DAG
    file) of a function ``(ctx, rows) -> columns``."""

    parallel: int = Field(default=1, ge=1)
    """Data-parallel workers of this node; rows are redistributed between nodes of different sizes."""

    resources: NodeResources = NodeResources()
    """Where the node's workers run."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options handed to the node's function (e.g. the column a reward is read from)."""


class DagSpec(Section):
    name: str
    """Name shown by ``sluice plan-dag`` and in metrics."""

    description: str = ""
    """What the DAG computes, for people reading it."""

    inputs: tuple[str, ...] = ("prompt",)
    """Columns the distributed data loader provides to ``generate`` nodes (one prompt per group)."""

    nodes: tuple[DagNode, ...] = Field(min_length=1)
    """The nodes; edges follow from the columns they read and write, plus ``depends_on``."""

    @model_validator(mode="after")
    def _unique_ids(self) -> DagSpec:
        seen: set[str] = set()
        for node in self.nodes:
            if node.id in seen:
                raise ValueError(f"node {node.id!r}: two nodes have this id")
            seen.add(node.id)
        return self

    def node(self, node_id: str) -> DagNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)


def builtin_dag_path(name: str) -> Path:
    """The file of built-in DAG ``name`` (one of ``BUILTIN_DAGS``)."""
    if name not in BUILTIN_DAGS:
        raise DagError(f"unknown built-in DAG {name!r} (built-in: {', '.join(BUILTIN_DAGS)})")
    return Path(str(package_files.files("sluice.dag") / "builtin" / f"{name}.yaml"))


def load_dag(source: str | Path) -> DagSpec:
    """Read a DAG from a built-in name (``grpo``) or a YAML file path; errors name the file and field."""
    text_source = str(source)
    path = builtin_dag_path(text_source) if text_source in BUILTIN_DAGS else Path(text_source)
    if not path.is_file():
        raise DagError(f"DAG file {path} does not exist (built-in DAGs: {', '.join(BUILTIN_DAGS)})")
    raw = yaml.safe_load(path.read_text())
    return parse_dag(_anchor_function_files(raw, path.parent), str(path))


def _anchor_function_files(raw: Any, folder: Path) -> Any:
    """``function: file.py:name`` is relative to the DAG file's folder; make it absolute."""
    for node in raw.get("nodes") or [] if isinstance(raw, dict) else []:
        function = node.get("function") if isinstance(node, dict) else None
        if isinstance(function, str) and ".py:" in function and not Path(function).is_absolute():
            node["function"] = str((folder / function).resolve())
    return raw


def parse_dag(raw: Any, where: str = "<dag>") -> DagSpec:
    """Validate a DAG given as plain data (what ``yaml.safe_load`` returns)."""
    if not isinstance(raw, dict):
        raise DagError(f"{where}: a DAG file is a mapping with 'name' and 'nodes'")
    try:
        return DagSpec.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        loc = _location(raw, first["loc"])
        raise DagError(f"{where}: {loc}: {first['msg']}") from None


def _location(raw: dict[str, Any], loc: tuple[Any, ...]) -> str:
    """``nodes[2].reads`` becomes ``node 'ref' field reads`` when the node has an id."""
    if len(loc) >= 2 and loc[0] == "nodes" and isinstance(loc[1], int):
        nodes = raw.get("nodes") or []
        node = nodes[loc[1]] if loc[1] < len(nodes) and isinstance(nodes[loc[1]], dict) else {}
        name = f"node {node['id']!r}" if "id" in node else f"nodes[{loc[1]}]"
        rest = ".".join(str(p) for p in loc[2:])
        return f"{name} field {rest}" if rest else name
    return ".".join(str(p) for p in loc) or "DAG"
