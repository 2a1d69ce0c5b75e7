"""RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024): each sample's baseline is the mean
reward of the *other* samples of its group.

``A_i = r_i - (Σ_{j≠i} r_j) / (n - 1) = n / (n - 1) · (r_i - mean)``; a group of one has no
baseline and gets advantage 0. Pure tensor math over ``[groups, n]``.
"""

from __future__ import annotations

import torch


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``[groups, n]`` rewards → ``[groups, n]`` leave-one-out advantages (float)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    n = rewards.shape[1]
    if n < 2:
        return torch.zeros_like(rewards)
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - others
