"""The algorithm as a DAG (DistFlow): a DAG file of nodes that read and write TransferQueue
columns, the planner that places it, the node functions and the generic node worker a training
run serves them with (``node_worker.py``, ``run_dag.py``). The DistFlow benchmark runtime
lives in ``benchmarks/distflow/``.

``load_dag`` reads a file (or a built-in name), ``compile_dag`` validates and places it; see
``docs/dag.md``. Importing this package never imports torch or Ray.
"""

from sluice.dag.planner import PLACEMENTS, Plan, WorkerGroup, compile_dag
from sluice.dag.spec import BUILTIN_DAGS, DagError, DagNode, DagSpec, load_dag, parse_dag

__all__ = [
    "BUILTIN_DAGS",
    "PLACEMENTS",
    "DagError",
    "DagNode",
    "DagSpec",
    "Plan",
    "WorkerGroup",
    "compile_dag",
    "load_dag",
    "parse_dag",
]
