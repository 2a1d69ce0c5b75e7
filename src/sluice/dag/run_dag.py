"""The DAG of a training run: ``run.dag`` resolved, compiled, checked, and split over the workers.

``run.dag: null`` picks the built-in DAG of the algorithm (``grpo``, ``grpo_kl`` with a KL term,
``ppo``, ``ppo_kl``). A DAG must agree with the trainer's config — a critic node exactly when
``trainer.algorithm: ppo``, a reference node exactly when ``trainer.kl_coef > 0``. Both modes
run it on the same workers (``DagPlacement``): rollout in the rollout worker; the advantages
(GRPO's, or GAE) and the actor and critic updates inside the trainer's step; every other node
(reference log-probs, critic values, user compute nodes such as extra rewards) in a
``NodeTaskWorker`` of its own, serving the TransferQueue task named after the node. Errors are
``ConfigError`` s naming ``run.dag``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.config import ConfigError
from sluice.dag.planner import Plan, compile_dag
from sluice.dag.spec import DagError, DagNode, load_dag

CRITIC_FUNCTIONS = frozenset({"critic_values", "gae_advantages", "critic_update"})
TRAINER_FUNCTIONS = frozenset({"group_advantages", "gae_advantages", "actor_update", "critic_update"})
"""Node functions the trainer runs inside its step (every other node after rollout gets a worker)."""


@dataclass(frozen=True)
class DagPlacement:
    """Which worker serves which node of a run's DAG, and the queue tasks that follow."""

    tasks: dict[str, tuple[str, ...]]
    """Every queue task and its input columns: ``train_task`` and one per node worker (its id)."""
    node_workers: tuple[DagNode, ...]
    """Nodes after rollout served by a ``NodeTaskWorker`` each (reference, critic values, user nodes)."""
    reward_column: str | None = None
    """The column the advantages read as the reward (``options.reward_column``), else ``None``."""


def default_dag(cfg: Any) -> str:
    """The built-in DAG for ``cfg.trainer`` (``SluiceConfig``)."""
    base = "ppo" if cfg.trainer.algorithm == "ppo" else "grpo"
    return f"{base}_kl" if cfg.trainer.kl_coef > 0 else base


def plan_for_run(cfg: Any) -> Plan:
    """The run's DAG, compiled colocated and checked; every problem is a ``ConfigError``."""
    source = cfg.run.dag or default_dag(cfg)
    try:
        plan = compile_dag(load_dag(source), "colocated")
    except DagError as err:
        raise ConfigError(f"run.dag: {err}") from None
    check_run_dag(plan, cfg)
    return plan


def check_run_dag(plan: Plan, cfg: Any) -> None:
    name = plan.spec.name
    functions = {n.function: n.id for n in plan.spec.nodes}
    for needed in ("rollout", "actor_update"):
        count = sum(n.function == needed for n in plan.spec.nodes)
        if count != 1:
            raise ConfigError(f"run.dag: DAG {name!r} has {count} nodes running {needed!r}; a training run needs one")
    critic = sorted(CRITIC_FUNCTIONS & functions.keys())
    if (cfg.trainer.algorithm == "ppo") != bool(critic):
        want = "needs the critic nodes" if cfg.trainer.algorithm == "ppo" else "has no critic, remove"
        raise ConfigError(
            f"run.dag: DAG {name!r} and trainer.algorithm {cfg.trainer.algorithm!r} disagree: the algorithm {want} "
            f"critic_values / gae_advantages / critic_update (built-in DAGs: grpo, grpo_kl, ppo, ppo_kl)"
        )
    if (cfg.trainer.kl_coef > 0) != ("reference_logprobs" in functions):
        raise ConfigError(
            f"run.dag: DAG {name!r} {'lacks' if cfg.trainer.kl_coef > 0 else 'has'} a reference_logprobs node "
            f"but trainer.kl_coef is {cfg.trainer.kl_coef} (the KL term needs it exactly when kl_coef > 0)"
        )
    for node in plan.spec.nodes:
        if node.function in TRAINER_FUNCTIONS and set(node.options) - {"reward_column"}:
            raise ConfigError(
                f"run.dag: node {node.id!r} ({node.function}) runs inside the trainer's step, which takes only the "
                f"option reward_column (got {sorted(node.options)})"
            )


def place_dag(plan: Plan, train_task: str) -> DagPlacement:
    """The run's workers for ``plan``: the trainer's task reads what the trainer's nodes read and
    do not write themselves; each other node after rollout is a task of its own."""
    nodes = [n for n in plan.spec.nodes if n.type != "generate"]
    apart = tuple(n for n in nodes if n.function not in TRAINER_FUNCTIONS)
    trainer = [n for n in nodes if n.function in TRAINER_FUNCTIONS]
    written = {c for n in trainer for c in n.writes}
    tasks = {n.id: tuple(n.reads) for n in apart}
    tasks[train_task] = tuple(dict.fromkeys(c for n in trainer for c in n.reads if c not in written))
    columns = {n.options["reward_column"] for n in trainer if "reward_column" in n.options}
    if len(columns) > 1:
        raise ConfigError(f"run.dag: the trainer's nodes read different reward columns {sorted(columns)}")
    return DagPlacement(tasks, apart, columns.pop() if columns else None)
