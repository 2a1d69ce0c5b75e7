"""Evaluation on the validation rows: greedy accuracy and, with ``eval.samples = k``, mean@k and
pass@k of ``k`` sampled responses per prompt, overall and per ``data_source``.

One evaluator serves the run's base / periodic / final evaluations and ``sluice eval``; the
multi-turn one (``rollout/agentic.py``) plays episodes instead of single responses and hands its
rewards to the same ``score_prompts``. A response is correct when its reward is ≥ ``threshold``
(1.0: the built-in rewards give 1 to a right answer). Per-prompt sampled rewards give
mean@k = the mean reward over all ``k × prompts`` responses and pass@k = the share of prompts with
at least one correct response of ``k`` (exact, as ``n = k``: no unbiased estimator needed).
Prompts split by ``fields['data_source']`` (``default`` without it) and, for built-in tasks whose
rows carry one, by ``fields['bucket']``.

It does not train, pick which rows to evaluate (``eval.max_prompts`` only truncates the list it is
given) or decide when evaluations happen (the controller's ``TrainingRun.eval_due``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.api import GenerationRequest, InferenceEngine, PromptItem, RewardFailure, RewardFn, SamplingParams
from sluice.config.data import EvalConfig
from sluice.rollout.single_turn import sample_seed

DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class EvalScores:
    """The scores of one set of prompts."""

    count: int
    """Prompts evaluated."""
    accuracy: float
    """Share of prompts whose greedy response is correct (reward ≥ the threshold)."""
    mean_reward: float
    """Mean reward of the greedy responses."""
    mean_at_k: float | None = None
    """Mean reward of the ``k`` sampled responses of every prompt (``None`` without sampling)."""
    pass_at_k: float | None = None
    """Share of prompts with at least one correct sampled response (``None`` without sampling)."""

    def metrics(self, suffix: str = "") -> dict[str, float]:
        """``accuracy``, ``mean_reward`` and, when sampled, ``mean@k`` / ``pass@k``, each + ``suffix``."""
        out = {f"accuracy{suffix}": self.accuracy, f"mean_reward{suffix}": self.mean_reward}
        if self.mean_at_k is not None and self.pass_at_k is not None:
            out |= {f"mean@k{suffix}": self.mean_at_k, f"pass@k{suffix}": self.pass_at_k}
        return out


@dataclass(frozen=True)
class EvalResult(EvalScores):
    """Scores over every prompt, and per source and bucket."""

    samples: int = 0
    """``k``: sampled responses per prompt (0: greedy only)."""
    by_source: dict[str, EvalScores] = field(default_factory=dict)
    """Per ``fields['data_source']`` (``default`` for rows without one)."""
    by_bucket: dict[str, EvalScores] = field(default_factory=dict)
    """Per ``fields['bucket']``, only when the rows carry one (built-in tasks' prompt kinds)."""

    def metrics(self, suffix: str = "") -> dict[str, float]:
        """The flat record of an ``eval`` line in ``metrics.jsonl``: the overall scores (``count``,
        ``samples``, ``accuracy``, ``mean_reward``, ``mean@k``, ``pass@k``), every source's as
        ``<name>/<source>`` and every bucket's accuracy as ``accuracy_<bucket>``."""
        out: dict[str, float] = {"count": self.count, "samples": self.samples, **super().metrics(suffix)}
        for source, scores in self.by_source.items():
            out |= scores.metrics(f"/{source}")
        out |= {f"accuracy_{bucket}": scores.accuracy for bucket, scores in self.by_bucket.items()}
        return out


def score_prompts(
    items: Sequence[PromptItem],
    greedy: Sequence[float],
    sampled: Sequence[Sequence[float]] | None = None,
    threshold: float = 1.0,
) -> EvalResult:
    """Aggregate per-prompt rewards: ``greedy[i]`` and ``sampled[i]`` (``k`` rewards) of ``items[i]``."""
    k = len(sampled[0]) if sampled else 0
    rows = [
        (item, g, list(sampled[i]) if sampled else []) for i, (item, g) in enumerate(zip(items, greedy, strict=True))
    ]
    sources: dict[str, list[tuple[PromptItem, float, list[float]]]] = {}
    buckets: dict[str, list[tuple[PromptItem, float, list[float]]]] = {}
    for row in rows:
        fields = row[0].fields
        sources.setdefault(str(fields.get("data_source", DEFAULT_SOURCE)), []).append(row)
        if "bucket" in fields:
            buckets.setdefault(str(fields["bucket"]), []).append(row)
    overall = _scores(rows, k, threshold)
    return EvalResult(
        count=overall.count,
        accuracy=overall.accuracy,
        mean_reward=overall.mean_reward,
        mean_at_k=overall.mean_at_k,
        pass_at_k=overall.pass_at_k,
        samples=k,
        by_source={name: _scores(group, k, threshold) for name, group in sorted(sources.items())},
        by_bucket={name: _scores(group, k, threshold) for name, group in sorted(buckets.items())},
    )


def _scores(rows: Sequence[tuple[PromptItem, float, list[float]]], k: int, threshold: float) -> EvalScores:
    n = max(len(rows), 1)
    greedy = [g for _, g, _ in rows]
    return EvalScores(
        len(rows),
        sum(g >= threshold for g in greedy) / n,
        sum(greedy) / n,
        mean_at_k=sum(sum(s) for _, _, s in rows) / (n * k) if k else None,
        pass_at_k=sum(any(r >= threshold for r in s) for _, _, s in rows) / n if k else None,
    )


def evaluate(
    engine: InferenceEngine,
    items: Sequence[PromptItem],
    tokenizer: object,
    reward: RewardFn,
    max_new_tokens: int,
    config: EvalConfig | None = None,
    *,
    seed: int = 0,
    threshold: float = 1.0,
) -> EvalResult:
    """Evaluate ``items`` with ``engine`` (blocking); see ``evaluate_async``."""
    return asyncio.run(
        evaluate_async(engine, items, tokenizer, reward, max_new_tokens, config, seed=seed, threshold=threshold)
    )


async def evaluate_async(
    engine: InferenceEngine,
    items: Sequence[PromptItem],
    tokenizer: Any,
    reward: RewardFn,
    max_new_tokens: int,
    config: EvalConfig | None = None,
    *,
    seed: int = 0,
    threshold: float = 1.0,
) -> EvalResult:
    """One greedy response per prompt and ``config.samples`` sampled ones at ``config.temperature``
    (seeded by ``seed``, the prompt's index and the sample's: the same draws at every evaluation,
    disjoint from training's), all generated at once, then scored; for callers already on an
    event loop (rollout workers)."""
    config = config or EvalConfig()
    items = list(items)[: config.max_prompts]
    stop = (tokenizer.eos_token_id,)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop)
    hot = SamplingParams(max_new_tokens=max_new_tokens, temperature=config.temperature, stop_token_ids=stop)
    k = config.samples
    requests = [GenerationRequest(f"eval-{it.index}", it.prompt_ids, greedy) for it in items]
    requests += [
        GenerationRequest(
            f"eval-{it.index}-s{j}",
            it.prompt_ids,
            hot,
            seed=sample_seed(seed, -1 - it.index, j),
            affinity=f"eval-{it.index}",
        )
        for it in items
        for j in range(k)
    ]
    completions = await asyncio.gather(*(engine.generate(r) for r in requests))
    texts = [tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in completions]
    fields = [it.fields for it in items] + [it.fields for it in items for _ in range(k)]
    rewards = await asyncio.gather(*(_score(reward, text, f) for text, f in zip(texts, fields, strict=True)))
    n = len(items)
    sampled = [rewards[n + i * k : n + (i + 1) * k] for i in range(n)] if k else None
    return score_prompts(items, rewards[:n], sampled, threshold)


async def _score(reward: RewardFn, response: str, fields: dict[str, Any]) -> float:
    try:
        value = reward(response, **fields)
        return float(await value) if inspect.isawaitable(value) else float(value)
    except RewardFailure:  # counted by the reward service; an answer that cannot be scored is no hit
        return 0.0
