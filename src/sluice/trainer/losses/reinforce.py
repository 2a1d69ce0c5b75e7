"""REINFORCE-style losses with clipped or truncated importance weights: CISPO and TOPR.

Both are ``-sg(weight) · A_t · logp_t`` per token (the weight is a constant, the gradient flows
only through ``logp``), times the behaviour weight ``w_t`` (``common.behaviour_weight``) like
every sluice loss; ``u_t = exp(logp - prox_logp)``:

- CISPO (MiniMax-M1, arXiv 2506.13585): ``weight = min(u_t, 1 + ε_high)``. Unlike PPO no token
  loses its gradient; only the IS weight is bounded, from above (the paper sets no lower bound:
  a floor ``1 - ε_low`` keeps pushing tokens the policy already left at nearly full strength,
  and off-policy training collapses; ``clip_low`` adds that floor only when passed).
- TOPR (Tapered Off-Policy REINFORCE, arXiv 2503.14286): tokens with ``A_t > 0`` get no IS
  weight (SFT-like, ``weight = 1``); the others get the truncated ``clamp(u_t, 0, 1)``.
"""

from __future__ import annotations

import torch

from sluice.api.types import LossInputs, LossOutputs
from sluice.trainer.losses.common import (
    AggMode,
    TISLevel,
    TISMode,
    aggregate,
    behaviour_weight,
    check_inputs,
    common_stats,
    masked_sum,
)


def cispo_loss(
    inputs: LossInputs,
    clip_low: float | None = None,
    clip_high: float = 0.2,
    behav_weight_cap: float | None = None,
    behav_cap_mode: TISMode = "cap",
    behav_weight_level: TISLevel = "token",
    agg_mode: AggMode = "token-mean",
) -> LossOutputs:
    """CISPO: ``l_t = -w_t · sg(min(u_t, 1 + clip_high)) · A_t · logp_t`` (``clip_low``, if given,
    also floors the IS weight at ``1 - clip_low``; the trainer never passes it).

    Stats as ``ppo_clip_loss`` (``clipped_tokens``: tokens whose IS weight was clipped).
    """
    check_inputs(inputs)
    mask = inputs.mask.bool()
    logp = torch.where(mask, inputs.logp, torch.zeros_like(inputs.logp))
    ratio = torch.exp(torch.where(mask, logp.detach() - inputs.prox_logp.detach(), torch.zeros_like(logp)))
    is_weight = torch.clamp(ratio, min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)
    return _reinforce(inputs, logp, ratio, is_weight, behav_weight_cap, behav_cap_mode, behav_weight_level, agg_mode)


def topr_loss(
    inputs: LossInputs,
    behav_weight_cap: float | None = None,
    behav_cap_mode: TISMode = "cap",
    behav_weight_level: TISLevel = "token",
    agg_mode: AggMode = "token-mean",
) -> LossOutputs:
    """TOPR: ``l_t = -w_t · A_t · logp_t`` if ``A_t > 0``, else ``-w_t · sg(clamp(u_t, 0, 1)) · A_t · logp_t``.

    ``clipped_tokens`` counts negative tokens whose weight the truncation lowered (``u_t > 1``).
    """
    check_inputs(inputs)
    mask = inputs.mask.bool()
    logp = torch.where(mask, inputs.logp, torch.zeros_like(inputs.logp))
    ratio = torch.exp(torch.where(mask, logp.detach() - inputs.prox_logp.detach(), torch.zeros_like(logp)))
    positive = inputs.advantages.detach() > 0
    is_weight = torch.where(positive, torch.ones_like(ratio), torch.clamp(ratio, 0.0, 1.0))
    return _reinforce(inputs, logp, ratio, is_weight, behav_weight_cap, behav_cap_mode, behav_weight_level, agg_mode)


def _reinforce(
    inputs: LossInputs,
    logp: torch.Tensor,
    ratio: torch.Tensor,
    is_weight: torch.Tensor,
    cap: float | None,
    mode: TISMode,
    level: TISLevel,
    agg_mode: AggMode,
) -> LossOutputs:
    """``-w · sg(is_weight) · A · logp`` on masked-in tokens, aggregated; ``[tokens]`` inputs."""
    mask = inputs.mask.bool()
    weight, capped = behaviour_weight(inputs, cap, mode, level)
    pg = -inputs.advantages.detach() * is_weight.detach() * logp
    per_token = torch.where(mask, pg * weight, torch.zeros_like(pg))
    loss = aggregate(per_token, inputs, agg_mode)
    stats = common_stats(inputs, weight, capped, per_token)
    with torch.no_grad():
        stats["clipped_tokens"] = float((mask & (is_weight != ratio) & (inputs.advantages != 0)).sum())
        stats["ratio_sum"] = masked_sum(ratio, mask)
    return LossOutputs(loss=loss, stats=stats)
