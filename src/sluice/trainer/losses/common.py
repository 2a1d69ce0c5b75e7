"""What every policy loss shares: aggregation modes, the behaviour weight (truncated IS), stats.

Aggregation (verl's names). Each mode is a *sum* over a micro-batch divided by a step-wide
normaliser, so micro-batch losses add up exactly to the whole step's loss:

- ``token-mean``: ``Σ_t m_t l_t / N_tokens`` (N = the step's loss tokens);
- ``seq-mean-token-sum``: ``Σ_t m_t l_t / N_seqs`` (each sequence's token sum, averaged);
- ``seq-mean-token-mean``: ``Σ_s (Σ_{t∈s} m_t l_t / Σ_{t∈s} m_t) / N_seqs``.

``N_seqs`` counts sequences with at least one loss token (fully masked ones add 0 either way).
``agg_normaliser`` computes the step-wide denominator from the step's loss masks; the
trainer sums micro-batches with normaliser 1 and scales the gradient by it once at the end.

Behaviour weight (DESIGN.md "Losses see three policies"): every loss is the loss of θ against
the proximal policy, times ``w = sg(π_prox / π_behav)``, optionally truncated (TIS) at token
level (``w_t``) or sequence level (``w_s = exp(Σ_{t∈s} (prox − behav))``, one weight for all of
a sequence's tokens), by clamping (``cap``) or by zeroing the tokens / sequences above the cap
(``mask``). With ``prox == behav`` the weight is 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from sluice.api.types import LossInputs

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
TISMode = Literal["cap", "clamp", "mask"]
TISLevel = Literal["token", "sequence"]


def agg_normaliser(mode: str, loss_masks: Sequence[Sequence[int]]) -> float:
    """The step-wide denominator of ``mode`` over the step's per-sample loss masks (≥ 1)."""
    if mode == "token-mean":
        return float(max(sum(sum(m) for m in loss_masks), 1))
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float(max(sum(1 for m in loss_masks if sum(m) > 0), 1))
    raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {AGG_MODES}")


def aggregate(per_token: torch.Tensor, inputs: LossInputs, mode: str) -> torch.Tensor:
    """Scalar loss of one micro-batch: the mode's sum over ``per_token [tokens]`` (already zero
    on masked tokens) divided by ``inputs.normaliser``."""
    if inputs.normaliser <= 0:
        raise ValueError(f"normaliser must be > 0, got {inputs.normaliser}")
    if mode in ("token-mean", "seq-mean-token-sum"):
        return per_token.sum() / inputs.normaliser
    if mode == "seq-mean-token-mean":
        seq = segment_ids(inputs)
        n = len(inputs.seq_lengths) if inputs.seq_lengths is not None else 0
        sums = torch.zeros(n, dtype=per_token.dtype, device=per_token.device).index_add(0, seq, per_token)
        counts = torch.zeros(n, dtype=per_token.dtype, device=per_token.device)
        counts = counts.index_add(0, seq, inputs.mask.to(per_token.dtype))
        return (sums / counts.clamp(min=1.0)).sum() / inputs.normaliser
    raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {AGG_MODES}")


def segment_ids(inputs: LossInputs) -> torch.Tensor:
    """``[tokens]`` long: the index of the sequence each token belongs to (needs ``seq_lengths``)."""
    lengths = inputs.seq_lengths
    if lengths is None:
        raise ValueError("this loss / aggregation mode needs LossInputs.seq_lengths (sequence boundaries)")
    lengths = lengths.to(device=inputs.logp.device, dtype=torch.long)
    if int(lengths.sum()) != inputs.logp.numel():
        raise ValueError(f"seq_lengths sum to {int(lengths.sum())}, but there are {inputs.logp.numel()} tokens")
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)


def seq_masked_mean(values: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """``[seqs]``: the mean of ``values [tokens]`` over each sequence's masked-in tokens (0 if none)."""
    zero = torch.zeros(n_seqs, dtype=values.dtype, device=values.device)
    sums = zero.index_add(0, seq, torch.where(mask, values, torch.zeros_like(values)))
    counts = zero.index_add(0, seq, mask.to(values.dtype))
    return sums / counts.clamp(min=1.0)


def behaviour_weight(
    inputs: LossInputs, cap: float | None = None, mode: TISMode = "cap", level: TISLevel = "token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached behaviour weight ``[tokens]`` and the bool ``[tokens]`` of capped tokens.

    ``cap=None`` leaves ``exp(prox − behav)`` untruncated. ``mode`` ``cap`` / ``clamp`` truncates
    to ``cap``; ``mask`` zeroes what exceeds it (masked tokens still count in the normaliser).
    ``level="sequence"`` uses one weight per sequence, ``exp(Σ_t (prox − behav))`` over its loss tokens.
    """
    mask = inputs.mask.bool()
    delta = torch.where(
        mask, inputs.prox_logp.detach() - inputs.behav_logp.detach(), torch.zeros_like(inputs.prox_logp)
    )
    if level == "token":
        weight = torch.exp(delta)
    elif level == "sequence":
        seq = segment_ids(inputs)
        n = len(inputs.seq_lengths) if inputs.seq_lengths is not None else 0
        log_w = torch.zeros(n, dtype=delta.dtype, device=delta.device).index_add(0, seq, delta)
        weight = torch.exp(log_w)[seq]
    else:
        raise ValueError(f"unknown tis level {level!r}")
    capped = torch.zeros_like(mask)
    if cap is None:
        return weight, capped
    capped = weight > cap
    if mode in ("cap", "clamp"):
        weight = torch.clamp(weight, max=cap)
    elif mode == "mask":
        weight = torch.where(capped, torch.zeros_like(weight), weight)
    else:
        raise ValueError(f"unknown tis mode {mode!r}")
    return weight, capped


WEIGHT_TAIL = 2.0
"""A behaviour weight beyond ×/÷ this is in the tail (``behav_weight_{low,high}_tokens``)."""


def off_policy_metrics(stats: dict[str, float]) -> dict[str, float]:
    """A step's off-policy picture from its summed loss stats (every rank's): the mean behaviour
    weight π_prox / π_behav, its effective sample size as a fraction of the tokens
    ``(Σw)² / (N Σw²)`` (1: no correction), the fractions of tokens in its tails, and the
    fractions of tokens whose ratio lies outside the clip range against the proximal policy
    (``clip_outside_prox``) and against the behaviour policy (``clip_outside_behav``); verl's
    ``pg_clipfrac`` as ``clip_ratio`` (tokens whose gradient the clip removed) and, with an entropy
    term or not, the mean token entropy (``entropy``)."""
    tokens = stats.get("tokens", 0.0)
    if tokens <= 0 or "behav_weight_sq_sum" not in stats:
        return {}
    total, squares = stats["behav_weight_sum"], stats["behav_weight_sq_sum"]
    out = {
        "behav_weight_mean": total / tokens,
        "behav_ess_fraction": total * total / (tokens * squares) if squares > 0 else 0.0,
        "behav_weight_low_fraction": stats["behav_weight_low_tokens"] / tokens,
        "behav_weight_high_fraction": stats["behav_weight_high_tokens"] / tokens,
    }
    for policy in ("prox", "behav"):
        if f"outside_{policy}_tokens" in stats:
            out[f"clip_outside_{policy}"] = stats[f"outside_{policy}_tokens"] / tokens
    for name, total_key in (("clip_ratio", "clipped_tokens"), ("entropy", "entropy_sum")):
        if total_key in stats:
            out[name] = stats[total_key] / tokens
    return out


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 KL estimator per token: ``(r - 1) - log r``, ``r = exp(log_ratio)``; ``[tokens]``."""
    log_ratio = log_ratio.detach()
    return torch.expm1(log_ratio) - log_ratio


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ ``values[mask]`` as a float; masked-out entries never leak inf / NaN."""
    return float(torch.where(mask, values.detach(), torch.zeros_like(values)).sum())


def check_inputs(inputs: LossInputs) -> None:
    """Same ``[tokens]`` shape everywhere and a positive normaliser."""
    shape = inputs.logp.shape
    for name in ("prox_logp", "behav_logp", "advantages", "mask"):
        other = getattr(inputs, name).shape
        if other != shape:
            raise ValueError(f"LossInputs.{name} has shape {tuple(other)}, logp has {tuple(shape)}")
    if inputs.normaliser <= 0:
        raise ValueError(f"normaliser must be > 0, got {inputs.normaliser}")


def common_stats(
    inputs: LossInputs, weight: torch.Tensor, capped: torch.Tensor, per_token: torch.Tensor
) -> dict[str, float]:
    """Summed stats every loss reports (``tokens``, behaviour weight, KL estimates, loss sum), and
    the behaviour weight's spread: ``behav_weight_sq_sum`` (Σ w², for the effective sample size)
    and the tokens whose untruncated weight is below ``1 / WEIGHT_TAIL`` or above ``WEIGHT_TAIL``."""
    mask = inputs.mask.bool()
    logp = inputs.logp
    with torch.no_grad():
        raw = torch.exp(torch.where(mask, inputs.prox_logp - inputs.behav_logp, torch.zeros_like(logp)))
        return {
            "tokens": float(mask.sum()),
            "behav_weight_sum": masked_sum(weight, mask),
            "behav_weight_sq_sum": masked_sum(weight * weight, mask),
            "behav_weight_low_tokens": float((mask & (raw < 1.0 / WEIGHT_TAIL)).sum()),
            "behav_weight_high_tokens": float((mask & (raw > WEIGHT_TAIL)).sum()),
            "capped_tokens": float((mask & capped).sum()),
            "kl_behav_sum": masked_sum(k3(logp - inputs.behav_logp), mask),
            "kl_prox_sum": masked_sum(k3(logp - inputs.prox_logp), mask),
            "policy_loss_sum": float(per_token.detach().sum()),
        }
