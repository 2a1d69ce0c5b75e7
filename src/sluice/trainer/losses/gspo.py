"""GSPO (Group Sequence Policy Optimization, arXiv 2507.18071): PPO-clip on a sequence-level ratio.

Per sequence ``i`` with loss tokens ``y_i``::

    s_i   = exp((1 / |y_i|) Σ_{t∈y_i} (logp_t - prox_logp_t))       (length-normalised ratio)
    r_t   = exp(sg(log s_i) + logp_t - sg(logp_t))                  (value s_i, gradient via token t)
    l_t   = w_t · max(-A_t · r_t, -A_t · clip(r_t, 1 - ε_low, 1 + ε_high))

This is verl's token form ("GSPO-token"): with ``seq-mean-token-mean`` aggregation and a constant
advantage per sequence its value and gradient equal the paper's sequence objective
``-min(s_i A_i, clip(s_i) A_i)`` averaged over sequences. Needs ``LossInputs.seq_lengths``.
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
    segment_ids,
    seq_masked_mean,
)


def gspo_loss(
    inputs: LossInputs,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behav_weight_cap: float | None = None,
    behav_cap_mode: TISMode = "cap",
    behav_weight_level: TISLevel = "token",
    agg_mode: AggMode = "seq-mean-token-mean",
) -> LossOutputs:
    """GSPO loss of one micro-batch; ``ratio_sum`` sums the sequence ratio over loss tokens."""
    check_inputs(inputs)
    mask = inputs.mask.bool()
    seq = segment_ids(inputs)
    n_seqs = len(inputs.seq_lengths) if inputs.seq_lengths is not None else 0
    logp = torch.where(mask, inputs.logp, torch.zeros_like(inputs.logp))
    log_ratio = torch.where(mask, logp.detach() - inputs.prox_logp.detach(), torch.zeros_like(logp))
    log_s = seq_masked_mean(log_ratio, mask, seq, n_seqs)[seq]  # [tokens], constant per sequence
    ratio = torch.exp(log_s + logp - logp.detach())
    adv = inputs.advantages.detach()
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    weight, capped = behaviour_weight(inputs, behav_weight_cap, behav_cap_mode, behav_weight_level)
    per_token = torch.where(mask, pg * weight, torch.zeros_like(pg))
    loss = aggregate(per_token, inputs, agg_mode)
    stats = common_stats(inputs, weight, capped, per_token)
    with torch.no_grad():
        stats["clipped_tokens"] = float((mask & (pg_clipped > pg_unclipped)).sum())
        stats["ratio_sum"] = masked_sum(ratio, mask)
    return LossOutputs(loss=loss, stats=stats)
