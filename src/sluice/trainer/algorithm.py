"""Critic-free policy-gradient algorithm: an advantage estimator plus a policy loss, by name.

Role: implements the ``Algorithm`` Protocol (``api/protocols.py``) by composing an estimator
from ``trainer/algos`` (``ADVANTAGE_ESTIMATORS``: GRPO, Dr.GRPO, RLOO, REINFORCE++ and its
baseline variant) with a loss from ``trainer/losses`` (``POLICY_LOSSES``: decoupled PPO-clip,
CISPO, GSPO, TOPR), a truncated-IS behaviour weight and an aggregation mode. ``advantages``
groups samples by ``group_id`` (groups may be of unequal size, e.g. after a filter), computes
one scalar per sample from ``sample.reward`` and broadcasts it to every response token;
``normaliser`` is the step-wide denominator the aggregation mode asks for.

Optional regularizers (``trainer/losses/regularizers.py``): a KL to the frozen reference
policy, as a loss term or subtracted from each sequence's reward before the estimator, and an
entropy bonus. Deliberately not here: critics / GAE with values, PPO mini-batches
(``trainer/updates.py``), and anything that touches a model or an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sluice.api.types import LossInputs, LossOutputs, Sample
from sluice.trainer.algos import ADVANTAGE_ESTIMATORS, NEEDS_VALUES, WHOLE_BATCH_ESTIMATORS
from sluice.trainer.losses import AGG_MODES, CLIPPED_LOSSES, POLICY_LOSSES, agg_normaliser
from sluice.trainer.losses.regularizers import KL_ESTIMATORS, add_regularizers, sequence_kl


class GRPOAlgorithm:
    """Group / batch baselines with a (decoupled) off-policy loss.

    Args:
        estimator: a key of ``ADVANTAGE_ESTIMATORS``; with ``gae`` the advantages come from a
            critic (``trainer/ppo.py``) and ``advantages`` raises.
        clip_low, clip_high: ratio clip ``[1 - clip_low, 1 + clip_high]`` (PPO, GSPO); CISPO
            truncates its IS weight at ``1 + clip_high`` only; unused by TOPR.
        eps: added to the std (GRPO, REINFORCE++).
        behav_weight_cap: optional TIS cap on the behaviour weight ``π_prox / π_behav``.
        policy_loss: a key of ``POLICY_LOSSES``.
        loss_agg_mode: ``token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-mean``.
        dual_clip_c: PPO dual clip bound for negative advantages (``ppo_clip`` only).
        tis_mode, tis_level: ``cap`` / ``mask`` and ``token`` / ``sequence`` for the TIS cap.
        kl_coef, kl_estimator, kl_in: KL to the reference policy (``k1`` / ``k2`` / ``k3``),
            added to the ``loss`` or subtracted in the ``reward``; ``kl_coef = 0`` disables it.
        entropy_coef: weight of the entropy bonus (0 disables it).
    """

    def __init__(
        self,
        estimator: str = "grpo",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        eps: float = 1e-6,
        behav_weight_cap: float | None = None,
        policy_loss: str = "ppo_clip",
        loss_agg_mode: str = "token-mean",
        dual_clip_c: float | None = None,
        tis_mode: str = "cap",
        tis_level: str = "token",
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_in: str = "loss",
        entropy_coef: float = 0.0,
    ) -> None:
        if estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
        if policy_loss not in POLICY_LOSSES:
            raise ValueError(f"unknown policy_loss {policy_loss!r}; known: {sorted(POLICY_LOSSES)}")
        if loss_agg_mode not in AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {AGG_MODES}")
        if dual_clip_c is not None and policy_loss != "ppo_clip":
            raise ValueError("dual_clip_c applies to policy_loss 'ppo_clip' only")
        if kl_estimator not in KL_ESTIMATORS or kl_in not in ("loss", "reward"):
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS} and kl_in 'loss' or 'reward'")
        self.kl_coef, self.kl_estimator, self.kl_in = kl_coef, kl_estimator, kl_in
        self.entropy_coef = entropy_coef
        self.uses_entropy = entropy_coef != 0.0
        self.uses_reference = kl_coef != 0.0  # samples need ref_logprobs: a reference step runs first
        self.estimator = estimator
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.eps = eps
        self.behav_weight_cap = behav_weight_cap
        self.policy_loss = policy_loss
        self.loss_agg_mode = loss_agg_mode
        self.whole_batch_advantages = estimator in WHOLE_BATCH_ESTIMATORS or estimator in NEEDS_VALUES
        self._loss_kwargs: dict[str, Any] = {
            "behav_weight_cap": behav_weight_cap,
            "behav_cap_mode": tis_mode,
            "behav_weight_level": tis_level,
            "agg_mode": loss_agg_mode,
        }
        if policy_loss in CLIPPED_LOSSES:
            self._loss_kwargs["clip_high"] = clip_high
            if policy_loss != "cispo":  # CISPO's IS weight is truncated from above only (MiniMax-M1)
                self._loss_kwargs["clip_low"] = clip_low
        if dual_clip_c is not None:
            self._loss_kwargs["dual_clip_c"] = dual_clip_c

    def advantages(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per-response-token advantages aligned with ``samples`` (one constant per sample)."""
        if not samples:
            return []
        dense: dict[int, int] = {}
        group_index = torch.tensor([dense.setdefault(s.group_id, len(dense)) for s in samples], dtype=torch.long)
        rewards = torch.tensor([self.reward(s) for s in samples], dtype=torch.float64)
        tokens = torch.tensor([sum(s.loss_mask) for s in samples], dtype=torch.float64)
        scalar = ADVANTAGE_ESTIMATORS[self.estimator](rewards, group_index, tokens, self.eps).tolist()
        return [[scalar[i]] * len(s.response_ids) for i, s in enumerate(samples)]

    def reward(self, sample: Sample) -> float:
        """The reward the estimator sees: minus ``kl_coef · Σ_t kl_t`` (behaviour vs reference
        log-probs) when the KL is in the reward."""
        if not self.uses_reference or self.kl_in != "reward":
            return sample.reward
        if len(sample.ref_logprobs) != len(sample.response_ids):
            raise ValueError(f"sample {sample.uid!r} has no reference log-probs (KL in the reward needs them)")
        kl = sequence_kl(sample.behav_logprobs, sample.ref_logprobs, sample.loss_mask, self.kl_estimator)
        return sample.reward - self.kl_coef * kl

    def loss(self, inputs: LossInputs) -> LossOutputs:
        """The configured policy loss over one micro-batch (``[tokens]`` inputs), step-wide
        normalised, plus the KL (in-loss) and entropy terms."""
        out = POLICY_LOSSES[self.policy_loss](inputs, **self._loss_kwargs)
        kl_coef = self.kl_coef if self.kl_in == "loss" else 0.0
        return add_regularizers(out, inputs, self.loss_agg_mode, kl_coef, self.kl_estimator, self.entropy_coef)

    def normaliser(self, samples: Sequence[Sample]) -> float:
        """Step-wide denominator: loss tokens (token-mean) or non-empty sequences (seq-mean-*)."""
        return agg_normaliser(self.loss_agg_mode, [s.loss_mask for s in samples])
