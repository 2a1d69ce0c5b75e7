"""KL to a frozen reference policy and an entropy bonus: terms added to any policy loss.

Per response token, with ``δ_t = log π_ref(y_t) − log π_θ(y_t)`` (Schulman's estimators of
``KL(π_θ ‖ π_ref)`` from samples of π_θ):

- ``k1 = −δ`` (unbiased, high variance, can be negative);
- ``k2 = δ² / 2`` (biased, low variance, ≥ 0);
- ``k3 = exp(δ) − 1 − δ`` (unbiased, low variance, ≥ 0; verl's ``low_var_kl``).

As a loss term the KL keeps its gradient through ``logp`` and is aggregated like the policy
loss (same mode, same step-wide normaliser), times ``kl_coef``. In the reward it is detached
and summed over a sequence's loss tokens: ``r' = r − kl_coef · Σ_t kl_t`` (the sequence-level
KL penalty of RLHF with scalar baselines). The entropy bonus subtracts ``entropy_coef`` times
the aggregated per-token entropy of π_θ (computed by the train engine from the full
distribution). Deliberately not here: computing reference log-probs (the ``reference_logprobs`` DAG node)
or entropies (``engines/hf_train.token_entropy``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.api.types import LossInputs, LossOutputs
from sluice.trainer.losses.common import aggregate, masked_sum

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """``[tokens]``: the per-token estimate of ``KL(π_θ ‖ π_ref)`` (gradient through ``logp``)."""
    delta = ref_logp.detach() - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator == "k3":
        return torch.expm1(delta) - delta
    raise ValueError(f"unknown kl estimator {estimator!r}; known: {KL_ESTIMATORS}")


def sequence_kl(
    logprobs: Sequence[float], ref_logprobs: Sequence[float], loss_mask: Sequence[int], estimator: str
) -> float:
    """Σ over one sequence's loss tokens of the per-token KL estimate (for KL in the reward)."""
    if len(ref_logprobs) != len(logprobs):
        raise ValueError(f"{len(ref_logprobs)} reference log-probs for {len(logprobs)} response tokens")
    logp = torch.tensor(logprobs, dtype=torch.float64)
    kl = kl_estimate(logp, torch.tensor(ref_logprobs, dtype=torch.float64), estimator)
    return float((kl * torch.tensor(loss_mask, dtype=torch.float64)).sum())


def add_regularizers(
    out: LossOutputs, inputs: LossInputs, agg_mode: str, kl_coef: float, kl_estimator: str, entropy_coef: float
) -> LossOutputs:
    """``out`` plus ``kl_coef ·`` the aggregated KL to the reference and minus ``entropy_coef ·``
    the aggregated entropy; adds ``kl_ref_sum`` / ``entropy_sum`` stats. Zero coefficients
    return ``out`` unchanged."""
    if not kl_coef and not entropy_coef:
        return out
    mask = inputs.mask.bool()
    zero = torch.zeros_like(inputs.logp)
    loss, stats = out.loss, dict(out.stats)
    if kl_coef:
        if inputs.ref_logp is None:
            raise ValueError("kl_coef > 0 with the KL in the loss needs reference log-probs (LossInputs.ref_logp)")
        kl = torch.where(mask, kl_estimate(inputs.logp, inputs.ref_logp, kl_estimator), zero)
        loss = loss + kl_coef * aggregate(kl, inputs, agg_mode)
        stats["kl_ref_sum"] = masked_sum(kl, mask)
    if entropy_coef:
        if inputs.entropy is None:
            raise ValueError("entropy_coef > 0 needs per-token entropies (LossInputs.entropy)")
        entropy = torch.where(mask, inputs.entropy, zero)
        loss = loss - entropy_coef * aggregate(entropy, inputs, agg_mode)
        stats["entropy_sum"] = masked_sum(entropy, mask)
    return LossOutputs(loss=loss, stats=stats)
