"""GRPO-family algorithm: group-relative advantages plus the decoupled PPO-clip loss.

Role: implements the ``Algorithm`` Protocol (``api/protocols.py``) by composing an advantage
estimator from ``trainer/algos`` (looked up by name in ``ADVANTAGE_ESTIMATORS``) with
``trainer/losses.ppo_clip_loss``. ``advantages`` groups samples by ``group_id`` (groups may
be of unequal size, e.g. after a filter), computes one scalar per sample from
``sample.reward`` and broadcasts it to every response token.

Deliberately not here: global-batch advantage normalisation, critics / GAE, KL-to-reference
terms, and anything that touches a model or an engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.api.types import LossInputs, LossOutputs, Sample
from sluice.trainer.algos import ADVANTAGE_ESTIMATORS
from sluice.trainer.losses import ppo_clip_loss


class GRPOAlgorithm:
    """GRPO / Dr.GRPO advantages with (decoupled) PPO-clip.

    Args:
        estimator: a key of ``ADVANTAGE_ESTIMATORS`` (``"grpo"`` or ``"dr_grpo"``).
        clip_low, clip_high: PPO ratio clip bounds ``[1 - clip_low, 1 + clip_high]``.
        eps: added to the group std (GRPO).
        behav_weight_cap: optional cap on the behaviour importance weight (see ``ppo_clip_loss``).
    """

    def __init__(
        self,
        estimator: str = "grpo",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        eps: float = 1e-6,
        behav_weight_cap: float | None = None,
    ) -> None:
        if estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
        self.estimator = estimator
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.eps = eps
        self.behav_weight_cap = behav_weight_cap

    def advantages(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per-response-token advantages aligned with ``samples`` (one constant per sample)."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group_id, []).append(i)
        estimate = ADVANTAGE_ESTIMATORS[self.estimator]
        scalar = [0.0] * len(samples)
        for members in groups.values():
            rewards = torch.tensor([[samples[i].reward for i in members]], dtype=torch.float64)
            values = estimate(rewards, self.eps)[0].tolist()
            for i, value in zip(members, values, strict=True):
                scalar[i] = value
        return [[scalar[i]] * len(s.response_ids) for i, s in enumerate(samples)]

    def loss(self, inputs: LossInputs) -> LossOutputs:
        """Decoupled PPO-clip over one micro-batch (``[tokens]`` inputs), step-wide normalised."""
        return ppo_clip_loss(
            inputs,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            behav_weight_cap=self.behav_weight_cap,
        )
