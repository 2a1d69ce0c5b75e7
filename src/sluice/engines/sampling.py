"""Per-sample, counter-based token sampling for the built-in inference engine.

A row's ``u`` for its ``i``-th generated token is ``hash(seed, i)`` (PCG), and its token inverts
the CDF of ``softmax(logits / T)`` (after top-p) at ``u``. Nothing depends on the batch neighbours
or on a global RNG, so a sample's tokens are the same alone or batched, and a row re-prefilled
after a weight update continues with the next counter. Not here: the batch bookkeeping
(``kv_batch.py``) and scheduling (``hf_inference.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_U32 = 0xFFFFFFFF


def _pcg(x: Any) -> Any:
    """PCG hash of uint32 values held in int64 (a Python int or a tensor); result in [0, 2**32)."""
    state = (x * 747796405 + 2891336453) & _U32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _U32
    return ((word >> 22) ^ word) & _U32


def seed_key(seed: int) -> int:
    """Mix a (possibly negative or > 32-bit) seed into a 32-bit per-sample key."""
    return _pcg(_pcg((seed >> 32) & _U32) ^ (seed & _U32))


def uniforms(key: Tensor, index: Tensor) -> Tensor:
    """Counter-based uniforms in [0, 1): ``key``, ``index`` [rows] int64 -> [rows] float64."""
    return _pcg((key + _pcg(index)) & _U32).double() * 2.0**-32


def _inverse_cdf(cum: Tensor, u: Tensor) -> Tensor:
    """First index whose cumulative mass exceeds ``u`` times the total: cum [rows, V], u [rows]."""
    return torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(1), right=True).squeeze(1)


def sample_tokens(logits: Tensor, temperature: Tensor, top_p: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """One token per row: logits [rows, V]; temperature, top_p, u [rows] -> (tokens, log-probs) [rows].

    ``temperature <= 0`` takes the argmax. The log-prob is ``log_softmax(logits / T)`` before top-p.
    Rows with ``top_p < 1`` invert the CDF over tokens sorted by probability, the others over
    vocabulary order; a row's result depends only on its own inputs.
    """
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    probs = logp.double().exp()
    tokens = _inverse_cdf(probs.cumsum(-1), u)
    nucleus = (top_p < 1) & ~greedy
    if bool(nucleus.any()):
        idx = nucleus.nonzero().squeeze(1)
        sorted_p, order = probs[idx].sort(dim=-1, descending=True, stable=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p[idx].double().unsqueeze(1)
        pick = _inverse_cdf(torch.where(keep, sorted_p, 0.0).cumsum(-1), u[idx])  # u < 1: a kept token
        tokens[idx] = order.gather(1, pick.unsqueeze(1)).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
