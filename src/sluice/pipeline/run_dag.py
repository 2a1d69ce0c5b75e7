"""The DAG of a training run: ``run.dag`` resolved, compiled, and checked against the config.

``run.dag: null`` picks the built-in DAG of the algorithm (``grpo``, ``grpo_kl`` with a KL term,
``ppo``, ``ppo_kl``). A DAG must agree with the trainer's config — a critic node exactly when
``trainer.algorithm: ppo``, a reference node exactly when ``trainer.kl_coef > 0`` — and with the
placement: ``run.mode: sync`` runs any DAG (one colocated chain, ``chain.py``), ``run.mode:
async`` the nodes its workers serve (rollout; the reference and the critic's values, each in a
worker of its own; advantages, GAE and the actor and critic updates in the trainer), and takes
its TransferQueue tasks from the DAG. Errors are ``ConfigError`` s naming ``run.dag``.
"""

from __future__ import annotations

from typing import Any

from sluice.config import ConfigError
from sluice.pipeline.planner import Plan, compile_dag
from sluice.pipeline.spec import DagError, load_dag

CRITIC_FUNCTIONS = frozenset({"critic_values", "gae_advantages", "critic_update"})
ASYNC_FUNCTIONS = frozenset({"rollout", "reference_logprobs", "group_advantages", "actor_update"}) | CRITIC_FUNCTIONS
"""Node functions the asynchronous pipeline's workers serve (rollout, reference, critic values, trainer)."""


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
    if cfg.run.mode == "async":
        for node in plan.spec.nodes:
            if node.function not in ASYNC_FUNCTIONS or node.options:
                raise ConfigError(
                    f"run.dag: node {node.id!r} ({node.function}) needs run.mode: sync; the asynchronous pipeline "
                    f"serves {', '.join(sorted(ASYNC_FUNCTIONS))} without options"
                )


def async_queue_tasks(plan: Plan, train_task: str, reference_task: str, critic_task: str) -> dict[str, tuple[str, ...]]:
    """The asynchronous pipeline's queue tasks from the DAG, one per worker: the reference and
    the critic-values tasks read what their node reads; the trainer's task reads what the other
    nodes after rollout read and do not write themselves (whatever their device pools)."""
    served_apart = {"reference_logprobs": reference_task, "critic_values": critic_task}
    nodes = [n for n in plan.spec.nodes if n.type != "generate"]
    tasks: dict[str, tuple[str, ...]] = {}
    for node in nodes:
        if node.function in served_apart:
            tasks[served_apart[node.function]] = tuple(node.reads)
    trainer = [n for n in nodes if n.function not in served_apart]
    written = {c for n in trainer for c in n.writes}
    tasks[train_task] = tuple(dict.fromkeys(c for n in trainer for c in n.reads if c not in written))
    return tasks
