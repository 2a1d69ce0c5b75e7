"""PPO-clip over three policies: AReaL's decoupled PPO (arXiv 2505.24298, Eq. 5), dual clip, DAPO clip-higher.

::

    u_t = exp(logp - prox_logp)                                  (trust region around prox)
    w_t = sg(exp(prox_logp - behav_logp))                        (behaviour weight, maybe truncated)
    p_t = max(-A_t · u_t, -A_t · clip(u_t, 1 - ε_low, 1 + ε_high))
    p_t = min(p_t, -c · A_t)            if A_t < 0 and dual clip c is set (c > 1)
    l_t = w_t · p_t

With ``prox_logp == behav_logp`` the weight is 1 and this is standard PPO-clip. Separate
``clip_low`` / ``clip_high`` give DAPO's clip-higher. Stats are detached *sums*; a trainer adds
them across micro-batches and divides once per step (``clipped_tokens / tokens``).
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


def ppo_clip_loss(
    inputs: LossInputs,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behav_weight_cap: float | None = None,
    behav_cap_mode: TISMode = "cap",
    behav_weight_level: TISLevel = "token",
    dual_clip_c: float | None = None,
    agg_mode: AggMode = "token-mean",
) -> LossOutputs:
    """Decoupled PPO-clip loss of one micro-batch.

    Args:
        inputs: ``logp`` (with grad), ``prox_logp``, ``behav_logp``, ``advantages``, ``mask``,
            all ``[tokens]``; ``normaliser`` the step-wide denominator (> 0).
        clip_low, clip_high: the ratio ``u`` is clipped to ``[1 - clip_low, 1 + clip_high]``.
        behav_weight_cap, behav_cap_mode, behav_weight_level: truncated IS on the behaviour
            weight (``common.behaviour_weight``); ``None`` leaves it unbounded.
        dual_clip_c: for ``A < 0`` bound the loss by ``-c · A`` (Ye et al. 2020); ``None`` disables.
        agg_mode: aggregation over tokens / sequences (``common.aggregate``).

    Returns:
        ``LossOutputs`` with the scalar loss and summed stats: ``tokens``, ``clipped_tokens``
        (tokens whose gradient the clip removed), ``dual_clipped_tokens``, ``ratio_sum`` (Σ u),
        ``behav_weight_sum`` (Σ w after capping), ``capped_tokens``, ``kl_behav_sum`` and
        ``kl_prox_sum`` (k3 estimates), ``policy_loss_sum`` (Σ l, unnormalised), and
        ``outside_prox_tokens`` / ``outside_behav_tokens``: tokens whose ratio against the
        proximal / the behaviour policy lies outside the clip range (``off_policy_metrics``).
    """
    check_inputs(inputs)
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    logp, prox, adv = inputs.logp, inputs.prox_logp.detach(), inputs.advantages.detach()
    mask = inputs.mask.bool()

    # Masked tokens get log-ratio 0 so that no inf / NaN can reach the gradient through them.
    zero = torch.zeros_like(prox)
    ratio = torch.exp(torch.where(mask, logp - prox, zero))
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)
    dual = torch.zeros_like(mask)
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)

    weight, capped = behaviour_weight(inputs, behav_weight_cap, behav_cap_mode, behav_weight_level)
    per_token = torch.where(mask, pg * weight, torch.zeros_like(pg))
    loss = aggregate(per_token, inputs, agg_mode)

    stats = common_stats(inputs, weight, capped, per_token)
    with torch.no_grad():
        stats["clipped_tokens"] = float((mask & (pg_clipped > pg_unclipped)).sum())
        stats["ratio_sum"] = masked_sum(ratio, mask)
        behav_ratio = ratio * torch.exp(torch.where(mask, prox - inputs.behav_logp.detach(), zero))
        for policy, against in (("prox", ratio), ("behav", behav_ratio)):  # π_θ / π_prox, π_θ / π_behav
            outside = (against < 1.0 - clip_low) | (against > 1.0 + clip_high)
            stats[f"outside_{policy}_tokens"] = float((mask & outside).sum())
        if dual_clip_c is not None:
            stats["dual_clipped_tokens"] = float((mask & dual).sum())
    return LossOutputs(loss=loss, stats=stats)
