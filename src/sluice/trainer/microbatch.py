"""Token-balanced dynamic micro-batching.

Role: (1) ``balance_by_tokens``: a pure partition of item token counts into bins of at most
``budget`` tokens, balanced by load. (2) ``make_micro_batches``: samples plus their per-token
signals → ``MicroBatch`` es that share one step-wide normaliser.

Balancing strategy (AReaL-style, deterministic): first-fit-decreasing (FFD) fixes the
number of bins ``k``; then items, largest first, go to the least-loaded of ``k`` bins that
still fits them (LPT), opening an extra bin only when none fits. An item larger than the
budget always gets a bin of its own. Ties break on the lower index, so the result depends
only on the token counts. Training steps cut micro-batches in arrival order instead
(``trainer/step.py``), so that streamed and whole-batch steps match bit for bit.

Deliberately not here: padding-free packing (varlen attention), sequence parallelism,
model forward passes and losses.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.api.types import MicroBatch, Sample


def balance_by_tokens(token_counts: Sequence[int], budget: int) -> list[list[int]]:
    """Partition item indices into bins whose token sums stay within ``budget``.

    Args:
        token_counts: ``[items]`` token count of each item (≥ 0).
        budget: maximum tokens per bin (> 0); an item above it forms a bin alone.

    Returns:
        Bins of indices; every index appears exactly once, indices ascending inside a bin,
        bins ordered by their first index. Empty input gives ``[]``.
    """
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if any(c < 0 for c in token_counts):
        raise ValueError("token counts must be non-negative")
    order = sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i))
    oversize = [i for i in order if token_counts[i] > budget]
    fitting = [i for i in order if token_counts[i] <= budget]

    ffd_loads: list[int] = []
    for i in fitting:
        slot = next((b for b, load in enumerate(ffd_loads) if load + token_counts[i] <= budget), None)
        if slot is None:
            ffd_loads.append(token_counts[i])
        else:
            ffd_loads[slot] += token_counts[i]

    bins: list[list[int]] = [[] for _ in ffd_loads]
    loads = [0] * len(bins)
    for i in fitting:
        fits = [b for b in range(len(bins)) if loads[b] + token_counts[i] <= budget]
        if not fits:
            bins.append([])
            loads.append(0)
            fits = [len(bins) - 1]
        target = min(fits, key=lambda b: (loads[b], b))
        bins[target].append(i)
        loads[target] += token_counts[i]

    result = [sorted(b) for b in bins if b] + [[i] for i in oversize]
    return sorted(result, key=lambda b: b[0])


def make_micro_batches(
    samples: Sequence[Sample],
    advantages: Sequence[Sequence[float]],
    prox_logprobs: Sequence[Sequence[float]],
    token_budget: int,
    normaliser: float | None = None,
) -> list[MicroBatch]:
    """Split one training step's samples into token-budgeted micro-batches.

    Args:
        samples: the step's samples; a sample's cost is ``prompt + response`` tokens.
        advantages, prox_logprobs: per-response-token values aligned with ``samples``.
        token_budget: maximum tokens per micro-batch (see ``balance_by_tokens``).
        normaliser: the step-wide loss denominator; defaults to the step's loss-token count
            (Σ ``loss_mask``, at least 1), i.e. token-mean over the global batch.

    Returns:
        Micro-batches in ``balance_by_tokens`` order, all sharing ``normaliser``.
    """
    if not len(samples) == len(advantages) == len(prox_logprobs):
        raise ValueError("samples, advantages and prox_logprobs must have the same length")
    if normaliser is None:
        normaliser = float(max(1, sum(sum(s.loss_mask) for s in samples)))
    bins = balance_by_tokens([s.num_tokens for s in samples], token_budget)
    return [
        MicroBatch(
            samples=tuple(samples[i] for i in b),
            advantages=tuple(tuple(advantages[i]) for i in b),
            prox_logprobs=tuple(tuple(prox_logprobs[i]) for i in b),
            normaliser=normaliser,
        )
        for b in bins
    ]
