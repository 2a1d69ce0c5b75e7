"""A group's reward-model scores combined with its rule rewards (``reward.combine``).

``ModelReward.apply`` asks the reward model (``RewardModelPool``) for a finished group's scores,
optionally normalises them by the run's running mean and standard deviation (Welford, every score
seen so far, the group's own included; counted), and returns the group's samples with
``reward = rule_weight · rule + model_weight · rm`` (``combine: sum``) or ``model_weight · rm``
(``combine: model``), the raw score in ``meta["rm_score"]`` and the rule reward in
``meta["rule_reward"]``. A failed scoring call, or a judge's answer its parser cannot read (NaN,
``rewards/judge.py``), marks every sample with the reward failure, so the rollout discards the
group with that reason like any failed reward. Deliberately not here: the
model's workers (``rewards/reward_model.py``), when a group is scored (``rollout/groups.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from sluice.api import RewardFailure, Sample


class RunningMoments:
    """Running mean and variance of every value added (Welford's update)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self._m2 = 0.0

    def add(self, values: Sequence[float]) -> None:
        for x in values:
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self._m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self.count) if self.count > 1 else 1.0


class ModelReward:
    """``await apply(prompt, samples, decode)``: the group's samples scored by the reward model."""

    def __init__(
        self,
        pool: Any,
        combine: str = "sum",
        model_weight: float = 1.0,
        rule_weight: float = 1.0,
        normalize: bool = False,
    ) -> None:
        self.pool = pool
        self.combine = combine
        self.model_weight = model_weight
        self.rule_weight = rule_weight
        self.moments = RunningMoments() if normalize else None
        self.normalised = 0

    async def apply(
        self, prompt: str, samples: Sequence[Sample], decode: Callable[[Sequence[int]], str]
    ) -> list[Sample]:
        try:
            raw = await self.pool.score([(prompt, decode(s.response_ids)) for s in samples])
        except RewardFailure as failure:
            cause = (f"reward {failure.name!r}", failure.detail)
            return [
                dataclasses.replace(s, meta={**s.meta, "reward_failure": failure.reason, "reward_failure_cause": cause})
                for s in samples
            ]
        unread = [k for k, x in enumerate(raw) if math.isnan(x)]  # a judge's garbage answer: never a silent 0
        if unread:
            name = getattr(self.pool, "name", "reward_model")
            cause = (f"reward {name!r}", f"sample {unread[0]}: an answer the judge's parser cannot read")
            failed = {"reward_failure": f"reward_invalid:{name}", "reward_failure_cause": cause}
            return [dataclasses.replace(s, meta={**s.meta, **failed}) for s in samples]
        scores = list(raw)
        if self.moments is not None:
            self.moments.add(scores)
            scores = [(x - self.moments.mean) / max(self.moments.std, 1e-6) for x in scores]
            self.normalised += len(scores)
        out = []
        for s, r, x in zip(samples, raw, scores, strict=True):
            meta = {**s.meta, "rm_score": float(r)}
            if self.combine == "sum":
                meta["rule_reward"] = s.reward
            rule = s.reward * self.rule_weight if self.combine == "sum" else 0.0
            out.append(dataclasses.replace(s, reward=rule + self.model_weight * x, meta=meta))
        return out

    def stats(self) -> dict[str, float]:
        out = dict(self.pool.stats())
        if self.moments is not None:
            out.update(
                rm_normalised=float(self.normalised), rm_running_mean=self.moments.mean, rm_running_std=self.moments.std
            )
        return out

    def close(self) -> None:
        self.pool.close()
