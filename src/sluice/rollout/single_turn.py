"""Single-turn workflow: one prompt → a group of ``n`` sampled responses → scored ``Sample`` s.

It owns the per-sample seeds (so a group's tokens depend only on the run seed and the group id,
never on batching or timing) and turns completions into samples. It does not decide when a
group is admitted or trained: that is the controller's job.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.api import (
    Completion,
    GenerationRequest,
    InferenceEngine,
    PromptItem,
    RewardFailure,
    RewardFn,
    Sample,
    SamplingParams,
)

log = logging.getLogger(__name__)

_MASK64 = (1 << 63) - 1


def sample_seed(run_seed: int, group_id: int, k: int) -> int:
    """A deterministic 63-bit seed for sample ``k`` of group ``group_id`` (splitmix64 mixing)."""
    x = (run_seed * 0x9E3779B97F4A7C15 + group_id * 0xBF58476D1CE4E5B9 + k * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 29
    return x


@dataclass(frozen=True)
class SingleTurnWorkflow:
    """Samples ``group_size`` responses for a prompt and scores each with ``reward``."""

    tokenizer: Any
    params: SamplingParams
    group_size: int
    run_seed: int = 0
    length_penalty: Callable[[int], float] | None = None
    """Added to each successful score, from the response's length in tokens (DAPO's overlong
    punishment, ``reward.overlong_buffer``); ``None``: none."""

    async def run(self, item: PromptItem, group_id: int, engine: InferenceEngine, reward: RewardFn) -> list[Sample]:
        """Generate the group; each sample is scored as soon as it finishes, overlapping the
        generation of its siblings (ROLL Flash's queue scheduling, at the sample level)."""

        async def one(request: GenerationRequest) -> tuple[Completion, float | RewardFailure]:
            completion = await engine.generate(request)
            return completion, await self._score(completion, item, reward)

        done = await asyncio.gather(*(one(r) for r in self.requests(item, group_id)))
        return [self._to_sample(c, score, item, group_id, k) for k, (c, score) in enumerate(done)]

    def requests(self, item: PromptItem, group_id: int) -> list[GenerationRequest]:
        """The group's ``group_size`` requests; they share an ``affinity`` (one prompt), which a
        proxy without prompt replication uses to keep them on one replica."""
        return [
            GenerationRequest(
                request_id=f"g{group_id}-s{k}",
                prompt_ids=item.prompt_ids,
                params=self.params,
                seed=sample_seed(self.run_seed, group_id, k),
                affinity=f"g{group_id}",
            )
            for k in range(self.group_size)
        ]

    async def generate(self, item: PromptItem, group_id: int, engine: InferenceEngine) -> list[Completion]:
        """Only the generation half of ``run`` (batch scheduling scores later, all at once)."""
        return list(await asyncio.gather(*(engine.generate(r) for r in self.requests(item, group_id))))

    async def score(
        self, item: PromptItem, group_id: int, completions: Sequence[Completion], reward: RewardFn
    ) -> list[Sample]:
        """The scoring half of ``run``: every completion's reward, concurrently."""
        scores = await asyncio.gather(*(self._score(c, item, reward) for c in completions))
        return [
            self._to_sample(c, score, item, group_id, k)
            for k, (c, score) in enumerate(zip(completions, scores, strict=True))
        ]

    def decode(self, completion: Completion) -> str:
        return self.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)

    async def _score(self, completion: Completion, item: PromptItem, reward: RewardFn) -> float | RewardFailure:
        """The reward, or the ``RewardFailure`` it raised (counted by the reward service; the
        rollout worker discards the group)."""
        try:
            value = reward(self.decode(completion), **item.fields)
            if inspect.isawaitable(value):
                value = await value
        except RewardFailure as failure:
            return failure
        if self.length_penalty is not None:
            return float(value) + self.length_penalty(len(completion.token_ids))
        return float(value)

    @staticmethod
    def _to_sample(c: Completion, score: float | RewardFailure, item: PromptItem, group_id: int, k: int) -> Sample:
        meta: dict[str, Any] = {"prompt_index": item.index, "finish_reason": c.finish_reason}
        if isinstance(score, RewardFailure):
            meta["reward_failure"] = score.reason
            meta["reward_failure_cause"] = (f"reward {score.name!r}", score.detail)
        return Sample(
            uid=f"{group_id}-{k}",
            group_id=group_id,
            prompt_ids=c.prompt_ids,
            response_ids=c.token_ids,
            behav_logprobs=c.logprobs,
            token_versions=c.versions,
            loss_mask=(1,) * len(c.token_ids),
            reward=float("nan") if isinstance(score, RewardFailure) else score,
            meta=meta,
        )
