"""Node functions: what a DAG node runs, the context it runs in, and the registry of built-ins.

A node function is ``fn(ctx: NodeContext, rows: Batch) -> {column: values}``: it gets the rows
of one step that its worker owns (the node's ``reads`` columns, in ascending row order) and
returns its ``writes`` columns aligned with them. A ``generate`` node gets one row per prompt
group (its ``prompt`` column) and returns ``group_size`` rows per group, group after group.
Model-backed built-ins find their engines in ``ctx.models`` (``model_nodes.ModelBindings``);
metrics go into ``ctx.metrics``. Built-ins are a plain dict of import paths, imported only
when a DAG uses them (so reading a DAG never imports torch). This module does not run nodes
(``chain.py``, ``runtime.py``) or place them (``planner.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.api import Batch
from sluice.dag.spec import DagError, DagNode

NodeFunction = Callable[["NodeContext", Batch], Mapping[str, Sequence[Any]]]

NODE_FUNCTIONS: dict[str, str] = {
    "rollout": "sluice.dag.model_nodes:rollout",
    "reference_logprobs": "sluice.dag.model_nodes:reference_logprobs",
    "group_advantages": "sluice.dag.model_nodes:group_advantages",
    "critic_values": "sluice.dag.model_nodes:critic_values",
    "gae_advantages": "sluice.dag.model_nodes:gae_advantages",
    "actor_update": "sluice.dag.model_nodes:actor_update",
    "critic_update": "sluice.dag.model_nodes:critic_update",
    "weighted_sum": "sluice.dag.compute_nodes:weighted_sum",
}
"""Built-in functions by name (the ``function:`` of a node), as ``module:attribute`` paths."""


@dataclass
class NodeContext:
    """What a node function may use besides its rows; one per node per worker, kept across steps."""

    node: DagNode
    rank: int = 0
    """This worker's rank among the node's ``parallel`` workers."""
    size: int = 1
    step: int = 0
    """The training step (global batch, queue partition) the rows belong to."""
    version: int = 0
    """Policy version of the weights this worker's models hold."""
    models: Any = None
    """Engines and algorithm of model-backed built-ins (``model_nodes.ModelBindings``)."""
    state: dict[str, Any] = field(default_factory=dict)
    """The function's own state across steps (e.g. a data-loader cursor)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of the current step; the worker reports and clears them."""

    @property
    def options(self) -> dict[str, Any]:
        return self.node.options


def resolve_function(node: DagNode) -> NodeFunction:
    """The callable behind ``node.function``; an unknown name or path is an error naming the node."""
    path = NODE_FUNCTIONS.get(node.function, node.function)
    if ".py:" in path:
        return _function_from_file(node, *path.rsplit(":", 1))
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    hint = f"built-in: {', '.join(sorted(NODE_FUNCTIONS))}; or an import path package.module:function"
    if not module_name or not attribute:
        raise DagError(f"node {node.id!r}: unknown function {node.function!r} ({hint})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise DagError(f"node {node.id!r}: function {node.function!r}: cannot import {module_name!r} ({err})") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise DagError(f"node {node.id!r}: unknown function {node.function!r} ({module_name} has no {attribute!r})")
    return fn  # type: ignore[no-any-return]


def _function_from_file(node: DagNode, file: str, attribute: str) -> NodeFunction:
    if not Path(file).is_file():
        raise DagError(f"node {node.id!r}: function file {file} does not exist")
    name = f"sluice_dag_{Path(file).stem}_{abs(hash(file))}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs (a dataclass looks its module up); pickling finds it there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise DagError(f"node {node.id!r}: unknown function {node.function!r} ({file} has no {attribute!r})")
    return fn  # type: ignore[no-any-return]


def apply_node(fn: NodeFunction, ctx: NodeContext, rows: Batch, expected_rows: int) -> dict[str, Sequence[Any]]:
    """Run ``fn`` and check it returned exactly the node's ``writes``, each with ``expected_rows``."""
    node = ctx.node
    out = dict(fn(ctx, rows))
    if set(out) != set(node.writes):
        raise DagError(f"node {node.id!r}: function returned columns {sorted(out)}, the DAG says {list(node.writes)}")
    for column, values in out.items():
        if len(values) != expected_rows:
            raise DagError(f"node {node.id!r}: column {column!r} has {len(values)} rows for {expected_rows}")
    return out
