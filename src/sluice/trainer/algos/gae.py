"""GAE (Schulman et al. 2016): generalised advantage estimation from a critic's values.

Per sequence, over its ``T`` response tokens (``values`` may carry a bootstrap ``V(s_T)`` as
entry ``T``; otherwise the value after the last token is 0)::

    δ_t = r_t + γ · V_{t+1} - V_t
    A_t = δ_t + γ λ · A_{t+1},    returns_t = A_t + V_t

Masked-out tokens (e.g. tool output inside a response) are skipped: they neither contribute a
δ nor break the recursion — the next *loss* token's value and advantage carry across them,
and their own advantage is 0. sluice has no critic yet, so the ``gae`` registry entry cannot
run from rewards alone; this module is the pure function a critic will feed.
"""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of one sequence.

    Args:
        rewards: ``[T]`` per-token rewards (an outcome reward sits on the last loss token).
        values: ``[T + 1]`` (last entry bootstraps the state after the sequence) or ``[T]``
            (terminal: the value after the last token is 0).
        gamma, lam: discount and GAE λ.
        mask: ``[T]`` bool / 0-1 loss mask; ``None`` means every token counts.

    Returns:
        ``(advantages [T], returns [T])``, both 0 on masked-out tokens.
    """
    T = rewards.shape[0]
    if values.shape[0] not in (T, T + 1):
        raise ValueError(f"values must be [T] or [T + 1] with T = {T}, got {tuple(values.shape)}")
    m = torch.ones(T, dtype=torch.bool) if mask is None else mask.bool()
    next_value = float(values[T]) if values.shape[0] == T + 1 else 0.0
    advantages = torch.zeros(T, dtype=rewards.dtype)
    returns = torch.zeros(T, dtype=rewards.dtype)
    running = 0.0
    for t in range(T - 1, -1, -1):
        if not m[t]:
            continue
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        running = delta + gamma * lam * running
        advantages[t] = running
        returns[t] = running + float(values[t])
        next_value = float(values[t])
    return advantages, returns
