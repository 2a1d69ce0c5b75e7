"""REINFORCE++ (Hu et al., arXiv 2501.03262): global batch whitening of returns, token-level.

With the outcome reward at the last token and γ = 1 (KL-in-reward is a separate concern), a
sample's return is its reward at every response token. REINFORCE++ whitens those returns over
*all loss tokens of the global batch*: a sample weighs as many times as it has loss tokens::

    μ = Σ_i c_i r_i / Σ_i c_i,   σ² = Σ_i c_i (r_i - μ)² / Σ_i c_i,   A_i = (r_i - μ) / (σ + eps)

REINFORCE++-baseline first subtracts the group mean (``r_i - mean_group(r)``), then whitens the
same way. Inputs are flat ``[samples]`` tensors; grouping is by a dense group index.
"""

from __future__ import annotations

import torch


def token_whiten(values: torch.Tensor, token_counts: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``[samples]`` values whitened with per-sample weights ``token_counts [samples]``."""
    weights = token_counts.to(values.dtype)
    total = weights.sum()
    if total <= 0:
        return torch.zeros_like(values)
    mean = (weights * values).sum() / total
    std = torch.sqrt((weights * (values - mean) ** 2).sum() / total)
    return (values - mean) / (std + eps)


def group_centre(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """``values [samples]`` minus the mean of their group (``group_index [samples]``, dense ids)."""
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    sums = torch.zeros(n_groups, dtype=values.dtype).index_add(0, group_index, values)
    counts = torch.zeros(n_groups, dtype=values.dtype).index_add(0, group_index, torch.ones_like(values))
    return values - (sums / counts)[group_index]


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, token_counts: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++: ``[samples]`` rewards → ``[samples]`` globally whitened advantages."""
    return token_whiten(rewards, token_counts, eps)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, token_counts: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++-baseline: group-mean baseline, then global token-level whitening."""
    return token_whiten(group_centre(rewards, group_index), token_counts, eps)
