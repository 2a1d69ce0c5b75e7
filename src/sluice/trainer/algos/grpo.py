"""GRPO group-relative advantage estimators (GRPO and Dr.GRPO).

Role: turn a ``[groups, n]`` table of scalar sequence rewards into scalar sequence
advantages, ``(r - group mean) / (group std + eps)`` (GRPO) or ``r - group mean``
(Dr.GRPO, ``scale_by_std=False``). Pure tensor math, no ``Sample`` in sight.

Deliberately not here: grouping samples by ``group_id`` (``algos/__init__.per_group``),
broadcasting an advantage to response tokens (``trainer/algorithm.py``), global-batch
normalisation (``reinforce_pp.py``), and any loss.

Std choice: the *population* std (``unbiased=False``, divide by n). It is defined for a
group of one (advantage 0, where the unbiased std is NaN) and only differs from the
unbiased std of TRL / verl by the factor ``sqrt((n - 1) / n)`` (≈ 0.97 at n = 16).
A group whose rewards are all equal gets advantage 0 either way.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: ``[groups, n]`` scalar rewards, one row per prompt group.
        eps: added to the group std before dividing.
        scale_by_std: ``False`` gives Dr.GRPO (mean-centred only).

    Returns:
        ``[groups, n]`` advantages, same dtype as ``rewards`` (float).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return centred / (std + eps)


def dr_grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr.GRPO: ``[groups, n]`` rewards → ``[groups, n]`` mean-centred advantages (``eps`` unused)."""
    return grpo_advantages(rewards, eps=eps, scale_by_std=False)
