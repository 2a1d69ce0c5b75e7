"""Policy losses over three policies: current θ, proximal (prox) and behaviour (behav).

Role: per-token policy-gradient objectives on flattened ``[tokens]`` tensors
(``LossInputs``), aggregated as ``sum(per_token · mask) / inputs.normaliser``. The normaliser
is step-wide (e.g. the loss-token count of the whole global batch), so the losses and the
gradients of a step's micro-batches add up exactly to those of one full-batch pass.

``ppo_clip_loss`` is AReaL's decoupled PPO (arXiv 2505.24298, Eq. 5)::

    u_t = exp(logp - prox_logp)                                  (trust region around prox)
    w_t = sg(exp(prox_logp - behav_logp))                        (behaviour importance weight)
    l_t = -w_t · min(u_t · A_t, clip(u_t, 1 - ε_low, 1 + ε_high) · A_t)

With ``prox_logp == behav_logp`` the weight is 1 and this is standard PPO-clip.

Stats are detached *sums* (never means), so a trainer adds them across micro-batches and
divides once per step (e.g. ``clipped_tokens / tokens`` is the clip fraction).

Deliberately not here: advantage estimation (``trainer/algos``), building the tensors from
samples (``engines/``, ``trainer/microbatch.py``), KL-to-reference and entropy terms, and
sequence-level aggregation modes. Other off-policy losses (TIS, CISPO, GSPO, TOPR) belong in
this module as further functions over the same ``LossInputs``.
"""

from __future__ import annotations

from typing import Literal

import torch

from sluice.api.types import LossInputs, LossOutputs

BehavCapMode = Literal["clamp", "mask"]


def ppo_clip_loss(
    inputs: LossInputs,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behav_weight_cap: float | None = None,
    behav_cap_mode: BehavCapMode = "clamp",
) -> LossOutputs:
    """Decoupled PPO-clip loss of one micro-batch.

    Args:
        inputs: ``logp`` (with grad), ``prox_logp``, ``behav_logp``, ``advantages``, ``mask``,
            all ``[tokens]``; ``normaliser`` the step-wide denominator (> 0).
        clip_low, clip_high: the ratio ``u`` is clipped to ``[1 - clip_low, 1 + clip_high]``.
        behav_weight_cap: bound on the behaviour weight ``w``; ``None`` leaves it unbounded.
        behav_cap_mode: ``"clamp"`` truncates ``w`` to the cap (truncated IS, ROLL);
            ``"mask"`` zeroes tokens whose ``w`` exceeds the cap (AReaL's
            ``behave_imp_weight_cap``); masked tokens still count in the normaliser.

    Returns:
        ``LossOutputs`` with the scalar loss and summed stats: ``tokens``, ``clipped_tokens``
        (tokens whose gradient the clip removed), ``ratio_sum`` (Σ u), ``behav_weight_sum``
        (Σ w after capping), ``capped_tokens``, ``kl_behav_sum`` and ``kl_prox_sum`` (k3
        estimates of KL(behav‖θ) and KL(prox‖θ)), ``policy_loss_sum`` (Σ l, unnormalised).
    """
    logp, prox, behav, adv = inputs.logp, inputs.prox_logp, inputs.behav_logp, inputs.advantages
    _check_shapes(inputs)
    if inputs.normaliser <= 0:
        raise ValueError(f"normaliser must be > 0, got {inputs.normaliser}")
    mask = inputs.mask.bool()
    prox, behav, adv = prox.detach(), behav.detach(), adv.detach()

    # Masked tokens get log-ratio 0 so that no inf / NaN can reach the gradient through them.
    zero = torch.zeros_like(prox)
    ratio = torch.exp(torch.where(mask, logp - prox, zero))
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)

    weight = torch.exp(torch.where(mask, prox - behav, zero))
    capped = torch.zeros_like(mask)
    if behav_weight_cap is not None:
        capped = weight > behav_weight_cap
        if behav_cap_mode == "clamp":
            weight = torch.clamp(weight, max=behav_weight_cap)
        elif behav_cap_mode == "mask":
            weight = torch.where(capped, torch.zeros_like(weight), weight)
        else:
            raise ValueError(f"unknown behav_cap_mode {behav_cap_mode!r}")

    per_token = torch.where(mask, pg * weight, torch.zeros_like(pg))
    loss = per_token.sum() / inputs.normaliser

    with torch.no_grad():
        stats = {
            "tokens": float(mask.sum()),
            "clipped_tokens": float((mask & (pg_clipped > pg_unclipped)).sum()),
            "ratio_sum": _masked_sum(ratio, mask),
            "behav_weight_sum": _masked_sum(weight, mask),
            "capped_tokens": float((mask & capped).sum()),
            "kl_behav_sum": _masked_sum(_k3(logp - behav), mask),
            "kl_prox_sum": _masked_sum(_k3(logp - prox), mask),
            "policy_loss_sum": float(per_token.sum()),
        }
    return LossOutputs(loss=loss, stats=stats)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 KL estimator per token: ``(r - 1) - log r``, ``r = exp(log_ratio)``; ``[tokens]``."""
    log_ratio = log_ratio.detach()
    return torch.expm1(log_ratio) - log_ratio


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ ``values[mask]`` as a float; masked-out entries never leak inf / NaN."""
    return float(torch.where(mask, values.detach(), torch.zeros_like(values)).sum())


def _check_shapes(inputs: LossInputs) -> None:
    shape = inputs.logp.shape
    for name in ("prox_logp", "behav_logp", "advantages", "mask"):
        other = getattr(inputs, name).shape
        if other != shape:
            raise ValueError(f"LossInputs.{name} has shape {tuple(other)}, logp has {tuple(shape)}")
