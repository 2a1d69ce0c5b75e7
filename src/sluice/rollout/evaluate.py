"""Held-out evaluation: greedy decoding of every prompt, scored by the task's reward.

The same evaluator serves the run's ``accuracy BASE -> FINAL`` line and ``sluice eval``. It
does not train or sample: temperature is 0, one response per prompt.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluice.api import GenerationRequest, InferenceEngine, PromptItem, RewardFailure, RewardFn, SamplingParams


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    """Share of prompts whose greedy response gets reward ≥ ``threshold``."""
    mean_reward: float
    count: int
    by_bucket: dict[str, float]
    """Accuracy per ``fields['bucket']`` value, when the task labels its prompts."""


def evaluate(
    engine: InferenceEngine,
    items: Sequence[PromptItem],
    tokenizer: object,
    reward: RewardFn,
    max_new_tokens: int,
    threshold: float = 1.0,
) -> EvalResult:
    """Greedy-decode ``items`` with ``engine`` and score them (blocking)."""
    return asyncio.run(evaluate_async(engine, items, tokenizer, reward, max_new_tokens, threshold))


async def evaluate_async(
    engine: InferenceEngine,
    items: Sequence[PromptItem],
    tokenizer: Any,
    reward: RewardFn,
    max_new_tokens: int,
    threshold: float = 1.0,
) -> EvalResult:
    """``evaluate`` as a coroutine, for callers already on an event loop (rollout workers)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    requests = [GenerationRequest(f"eval-{it.index}", it.prompt_ids, params) for it in items]
    completions = await asyncio.gather(*(engine.generate(r) for r in requests))
    texts = [tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in completions]
    rewards = await asyncio.gather(
        *(_score(reward, text, item.fields) for item, text in zip(items, texts, strict=True))
    )
    hits = [r >= threshold for r in rewards]
    buckets: dict[str, list[bool]] = {}
    for item, hit in zip(items, hits, strict=True):
        if "bucket" in item.fields:
            buckets.setdefault(str(item.fields["bucket"]), []).append(hit)
    n = max(len(items), 1)
    return EvalResult(
        accuracy=sum(hits) / n,
        mean_reward=sum(rewards) / n,
        count=len(items),
        by_bucket={k: sum(v) / len(v) for k, v in sorted(buckets.items())},
    )


async def _score(reward: RewardFn, response: str, fields: dict[str, Any]) -> float:
    try:
        value = reward(response, **fields)
        return float(await value) if inspect.isawaitable(value) else float(value)
    except RewardFailure:  # counted by the reward service; an answer that cannot be scored is no hit
        return 0.0
