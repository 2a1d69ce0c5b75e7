"""Per-response-token tensors of a training forward: chunking rows by length, flattening ragged
per-sample values, entropies, the train-inference log-prob gap.

Pure functions over ``Sample`` s and tensors, shared by the policy's and the critic's engines. No
model runs here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.api.types import LossInputs, Sample


def length_buckets(samples: Sequence[Sample], padded_token_budget: int) -> list[list[int]]:
    """Sample indices in length-sorted parts of at most ``padded_token_budget`` padded positions
    (a row longer than the budget goes alone)."""
    return buckets_of([s.num_tokens for s in samples], padded_token_budget)


def buckets_of(lengths: Sequence[int], padded_token_budget: int) -> list[list[int]]:
    """``length_buckets`` of rows of these ``lengths``."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    parts: list[list[int]] = []
    for i in order:
        longest = lengths[i]  # ascending, so the newest row is the longest
        if parts and (len(parts[-1]) + 1) * longest <= padded_token_budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts


def token_entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """``[tokens]`` entropy of each row of ``logp_all [tokens, vocab]`` (log-probabilities)."""
    return -(torch.exp(logp_all) * logp_all).sum(dim=-1)


def reference_logp(samples: Sequence[Sample], device: torch.device) -> torch.Tensor | None:
    """``[tokens]`` reference log-probs of ``samples``, or ``None`` unless every sample has them."""
    if not all(len(s.ref_logprobs) == len(s.response_ids) for s in samples):
        return None
    return flatten_rows([s.ref_logprobs for s in samples], device)


def flatten_rows(rows: Sequence[Sequence[float]], device: torch.device) -> torch.Tensor:
    """Ragged per-sample values → ``[tokens]`` float32."""
    return torch.tensor([x for row in rows for x in row], dtype=torch.float32, device=device)


def logprob_gap(inputs: LossInputs) -> dict[str, float]:
    """Mean and max ``|behaviour log-prob − the trainer's log-prob|`` over the loss tokens of one
    forward chunk (engine-vs-trainer drift; with stale samples it includes the policy's lag)."""
    mask = inputs.mask.bool()
    gap = (inputs.behav_logp - inputs.logp.detach()).abs()[mask]
    if not gap.numel():
        return {}
    return {"logprob_gap_mean": float(gap.mean()), "logprob_gap_max": float(gap.max())}
