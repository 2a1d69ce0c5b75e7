"""Built-in node functions backed by models: rollout, reference, critic, advantages, updates.

Each is one step of the classic code path cut at a column boundary, calling the same trainer
functions (``trainer/updates.py``, ``trainer/ppo.py``, ``trainer/sections.py``), so a built-in
DAG computes exactly what ``trainer/rl_step.py``'s ``train_global_batch`` computes (tested). The
engines come from ``ctx.models`` (``ModelBindings``): the run that places the node decides
which process holds which model. Nothing here chooses rows or moves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.api import Batch, PromptItem, Sample
from sluice.dag.functions import NodeContext
from sluice.dag.spec import DagError
from sluice.queue.samples import SAMPLE_COLUMNS, rows_to_samples, samples_to_rows


@dataclass
class ModelBindings:
    """The models and settings a worker's model-backed nodes use (absent ones are ``None``)."""

    algorithm: Any
    """``trainer.algorithm.GRPOAlgorithm``: advantages and the policy loss."""
    micro_batch_tokens: int
    schedule: Any
    """``trainer.updates.UpdateSchedule``."""
    temperature: float
    actor: Any = None
    """The policy's ``TrainEngine``."""
    reference: Any = None
    """The frozen reference's ``TrainEngine``."""
    critic: Any = None
    """``engines.critic.CriticEngine``."""
    gae_gamma: float = 1.0
    gae_lambda: float = 1.0
    generate: Callable[[Sequence[tuple[PromptItem, int]]], list[Sample]] | None = None
    """Generates and scores prompt groups ``(item, group id)`` with the current weights."""


def _models(ctx: NodeContext, *needed: str) -> ModelBindings:
    models = ctx.models
    if not isinstance(models, ModelBindings):
        raise DagError(f"node {ctx.node.id!r}: function {ctx.node.function!r} needs models, this worker has none")
    for name in needed:
        if getattr(models, name) is None:
            raise DagError(f"node {ctx.node.id!r}: function {ctx.node.function!r} needs the {name} model")
    return models


def _samples(ctx: NodeContext, rows: Batch) -> list[Sample]:
    """The rows as ``Sample`` s, with the reward taken from ``options.reward_column`` if given."""
    samples = rows_to_samples(rows)
    column = ctx.options.get("reward_column")
    if column is None:
        return samples
    if column not in rows.columns:
        raise DagError(f"node {ctx.node.id!r}: reward_column {column!r} is not among its reads")
    order = sorted(range(len(rows)), key=lambda k: rows.indices[k])
    return [dataclasses.replace(s, reward=float(rows.columns[column][k])) for s, k in zip(samples, order, strict=True)]


def rollout(ctx: NodeContext, rows: Batch) -> dict[str, list[Any]]:
    """Generate and score one group per row (``prompt`` column); writes the sample columns."""
    models = _models(ctx, "generate")
    assert models.generate is not None
    groups = [(item, m.group_id) for item, m in zip(rows.columns["prompt"], rows.meta, strict=True)]
    samples = models.generate(groups)
    size = len(samples) // max(len(groups), 1)
    columns: dict[str, list[Any]] = {c: [] for c in SAMPLE_COLUMNS}
    for _, gid in groups:
        group = [s for s in samples if s.group_id == gid]
        if len(group) != size:
            raise DagError(f"node {ctx.node.id!r}: group {gid} came back with {len(group)} of {size} samples")
        for name, values in samples_to_rows(group, size)[1].items():
            columns[name].extend(values)
    return {c: columns[c] for c in ctx.node.writes}


def reference_logprobs(ctx: NodeContext, rows: Batch) -> dict[str, list[Any]]:
    models = _models(ctx, "reference")
    ref = models.reference.logprobs(rows_to_samples(rows), models.temperature)
    return {ctx.node.writes[0]: [list(r) for r in ref]}


def group_advantages(ctx: NodeContext, rows: Batch) -> dict[str, list[Any]]:
    """The algorithm's advantage estimator (GRPO, RLOO, ...) over the rows' groups."""
    models = _models(ctx)
    return {ctx.node.writes[0]: models.algorithm.advantages(_samples(ctx, rows))}


def critic_values(ctx: NodeContext, rows: Batch) -> dict[str, list[Any]]:
    models = _models(ctx, "critic")
    return {ctx.node.writes[0]: models.critic.values(rows_to_samples(rows))}


def gae_advantages(ctx: NodeContext, rows: Batch) -> dict[str, list[Any]]:
    """GAE advantages (whitened over the rows) and returns from the critic's ``values`` column."""
    from sluice.trainer.ppo import gae_targets, loss_token_mean

    models = _models(ctx)
    samples = _samples(ctx, rows)
    values = _ordered(rows, "values")
    advantages, returns = gae_targets(samples, values, models.algorithm, models.gae_gamma, models.gae_lambda)
    ctx.metrics["value_mean"] = loss_token_mean(values, samples)
    ctx.metrics["return_mean"] = loss_token_mean(returns, samples)
    return {"advantages": advantages, "returns": returns}


def actor_update(ctx: NodeContext, rows: Batch) -> dict[str, list[Any]]:
    """One training step of the policy: proximal log-probs, then every update of the schedule."""
    from sluice.trainer.updates import merge_update_metrics, proximal_logprobs, run_updates, streamable

    models = _models(ctx, "actor")
    samples = rows_to_samples(rows)
    prox = proximal_logprobs(models.actor, samples, models.schedule, models.temperature)
    advantages = _ordered(rows, "advantages")
    balanced = not streamable(models.schedule, models.algorithm, critic=models.critic is not None)
    updates = run_updates(
        models.actor, samples, advantages, prox, models.algorithm, models.micro_batch_tokens, models.schedule,
        balanced=balanced,
    )  # fmt: skip
    ctx.metrics.update(merge_update_metrics(updates))
    return {}


def critic_update(ctx: NodeContext, rows: Batch) -> dict[str, list[Any]]:
    """The critic's value regression towards ``returns``, clipped around ``values``."""
    from sluice.trainer.ppo import critic_updates

    models = _models(ctx, "critic")
    samples = rows_to_samples(rows)
    ctx.metrics.update(
        critic_updates(models.critic, samples, _ordered(rows, "returns"), _ordered(rows, "values"), models.schedule)
    )
    return {}


def _ordered(rows: Batch, column: str) -> list[Any]:
    """``column`` in ascending row order (the order ``rows_to_samples`` returns)."""
    order = sorted(range(len(rows)), key=lambda k: rows.indices[k])
    values = rows.columns[column]
    return [list(values[k]) for k in order]
