"""Output-length ranking (StreamRL §4): predict which prompts will produce the longest responses.

- ``OnlineLengthRanker``, the built-in ``LengthPredictor``: a ridge regression of log response
  length on cheap prompt features (log prompt length, hashed token and token-pair frequencies),
  updated online from every finished (prompt, length) pair with exponential forgetting, so it
  follows the policy as its lengths drift. StreamRL fine-tunes a small LLM for this; a linear
  model is the light default, and the Protocol lets a stronger one replace it.
- ``lpt_order``: longest-predicted-first (LPT) order, the dispatch order that keeps one long
  sample from starting last and holding up the step.
- ``long_tail``: the predicted top share (StreamRL's k = 20 %).

Routing the predicted long tail to dedicated replicas is ``rollout/skew_dispatch.py``. This
module sees token ids and lengths only; it never generates or routes anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

_HASH_A = 0x9E3779B1
_HASH_B = 0x85EBCA77


class OnlineLengthRanker:
    """Online ridge regression ``log(1 + length) ~ features(prompt)`` (see the module docstring).

    ``buckets`` hashed features each for tokens and token pairs; ``memory``: observations after
    which an old one weighs ``1/e`` (the forgetting horizon); ``ridge``: L2 penalty.
    """

    def __init__(self, buckets: int = 64, memory: int = 4000, ridge: float = 1.0) -> None:
        if buckets < 1 or memory < 1 or ridge <= 0:
            raise ValueError(f"need buckets >= 1, memory >= 1, ridge > 0 (got {buckets}, {memory}, {ridge})")
        self.buckets = buckets
        self.decay = 1.0 - 1.0 / memory
        self.ridge = ridge
        dim = 3 + 2 * buckets
        self._gram = np.zeros((dim, dim))
        self._moment = np.zeros(dim)
        self._weights: np.ndarray = np.zeros(dim)
        self._stale = False
        self.observed = 0

    def features(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """``[3 + 2·buckets]``: bias, log prompt length, its square, token and pair frequencies."""
        n = len(prompt_ids)
        x = np.zeros(3 + 2 * self.buckets)
        log_n = math.log1p(n)
        x[0], x[1], x[2] = 1.0, log_n, log_n * log_n
        if n:
            ids = np.asarray(prompt_ids, dtype=np.int64)
            unigrams = (ids * _HASH_A) % self.buckets
            np.add.at(x, 3 + unigrams, 1.0 / n)
            if n > 1:
                pairs = (ids[:-1] * _HASH_A + ids[1:] * _HASH_B) % self.buckets
                np.add.at(x, 3 + self.buckets + pairs, 1.0 / (n - 1))
        return x

    def observe(self, prompt_ids: Sequence[int], length: int) -> None:
        if length < 0:
            raise ValueError(f"a response length cannot be negative, got {length}")
        x = self.features(prompt_ids)
        self._gram *= self.decay
        self._moment *= self.decay
        self._gram += np.outer(x, x)
        self._moment += x * math.log1p(length)
        self._stale = True
        self.observed += 1

    def predict(self, prompts: Sequence[Sequence[int]]) -> list[float]:
        if self._stale:
            penalty = self.ridge * np.eye(len(self._moment))
            penalty[0, 0] = 1e-9  # leave the bias (the mean log length) unpenalised
            self._weights = np.linalg.solve(self._gram + penalty, self._moment)
            self._stale = False
        if not prompts:
            return []
        design = np.stack([self.features(p) for p in prompts])
        return np.expm1(design @ self._weights).tolist()


def lpt_order(predicted: Sequence[float]) -> list[int]:
    """Indices of ``predicted`` longest first (ties keep their input order): LPT dispatch order."""
    return sorted(range(len(predicted)), key=lambda i: -predicted[i])


def long_tail(predicted: Sequence[float], share: float = 0.2) -> list[int]:
    """Indices of the ``ceil(share · n)`` longest predictions, longest first."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"long-tail share must be in (0, 1], got {share}")
    return lpt_order(predicted)[: math.ceil(share * len(predicted))]
