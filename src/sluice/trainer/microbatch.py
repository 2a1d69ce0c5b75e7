"""Token-balanced dynamic micro-batching and right-padded batch tensors.

Role: (1) ``balance_by_tokens``: a pure partition of item token counts into bins of at most
``budget`` tokens, balanced by load; the trainer uses it for micro-batches and the
TransferQueue for token-balanced selection across data-parallel ranks. (2)
``make_micro_batches``: samples plus their per-token signals → ``MicroBatch`` es that share
one step-wide normaliser. (3) ``pad_batch``: samples → right-padded model inputs plus the
index tensors that gather per-response-token log-probs.

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

import torch

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


def pad_batch(samples: Sequence[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``prompt + response`` sequences and index their response tokens.

    With ``B`` samples, ``T`` the longest sequence and ``N`` the total response tokens
    (sample order, then token order), the result holds:

    - ``input_ids`` ``[B, T]`` long, padded with ``pad_id``; ``attention_mask`` ``[B, T]`` long;
    - ``response_mask`` ``[B, T]`` bool, True where the token is a response token;
    - ``logit_rows``, ``logit_cols`` ``[N]`` long: the logits at ``[row, col]`` predict
      response token ``n`` (``col`` is one before the token's position);
    - ``targets`` ``[N]`` long: the response token ids;
    - ``loss_mask`` ``[N]`` bool and ``behav_logprobs`` ``[N]`` float32, flattened from the samples;
    - ``response_lengths`` ``[B]`` long, to split ``[N]`` back per sample.

    Every sample with a response needs a non-empty prompt (its first token is predicted by
    the last prompt position).
    """
    if not samples:
        raise ValueError("pad_batch needs at least one sample")
    width = max(s.num_tokens for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    response_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    rows: list[int] = []
    cols: list[int] = []
    for b, s in enumerate(samples):
        n_prompt, n_resp = len(s.prompt_ids), len(s.response_ids)
        if n_resp and not n_prompt:
            raise ValueError(f"sample {s.uid!r} has a response but an empty prompt")
        if not len(s.behav_logprobs) == len(s.loss_mask) == n_resp:
            raise ValueError(f"sample {s.uid!r}: behav_logprobs / loss_mask do not match the response")
        input_ids[b, : s.num_tokens] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention_mask[b, : s.num_tokens] = 1
        response_mask[b, n_prompt : s.num_tokens] = True
        rows.extend([b] * n_resp)
        cols.extend(range(n_prompt - 1, s.num_tokens - 1))
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "logit_rows": torch.tensor(rows, dtype=torch.long),
        "logit_cols": torch.tensor(cols, dtype=torch.long),
        **response_tensors(samples),
    }


def response_tensors(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """The per-response-token signals of ``samples`` flattened in order (any layout): ``targets``,
    ``loss_mask``, ``behav_logprobs`` ``[N]`` and ``response_lengths`` ``[B]``."""
    return {
        "targets": torch.tensor([t for s in samples for t in s.response_ids], dtype=torch.long),
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool),
        "behav_logprobs": torch.tensor([x for s in samples for x in s.behav_logprobs], dtype=torch.float32),
        "response_lengths": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
    }


def balance_shards(token_counts: Sequence[int], num_shards: int) -> list[list[int]]:
    """Split items into ``num_shards`` shards of equal size (±1 item) and near-equal token sums.

    The data-parallel counterpart of ``balance_by_tokens``: every rank of a stage gets the same
    number of rows (DistFlow's redistribution: 64 rows over 4 ranks give 16 each) while the
    token load is balanced by LPT under that size limit (largest item first, to the least-loaded
    shard that still has room; ties on the lower shard). Deterministic in the token counts.

    Args:
        token_counts: ``[items]`` token count of each item (≥ 0).
        num_shards: number of shards (> 0); shards beyond the item count stay empty.

    Returns:
        ``num_shards`` lists of indices, ascending inside a shard; shard ``k`` holds
        ``ceil`` or ``floor`` of ``items / num_shards`` items, the larger ones first.
    """
    if num_shards <= 0:
        raise ValueError(f"num_shards must be > 0, got {num_shards}")
    if any(c < 0 for c in token_counts):
        raise ValueError("token counts must be non-negative")
    n = len(token_counts)
    room = [n // num_shards + (1 if k < n % num_shards else 0) for k in range(num_shards)]
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    loads = [0] * num_shards
    for i in sorted(range(n), key=lambda i: (-token_counts[i], i)):
        target = min((k for k in range(num_shards) if len(shards[k]) < room[k]), key=lambda k: (loads[k], k))
        shards[target].append(i)
        loads[target] += token_counts[i]
    return [sorted(s) for s in shards]
