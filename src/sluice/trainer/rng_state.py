"""The random number generators of one process, captured and restored for a checkpoint.

Python's ``random``, NumPy's global generator and torch's (CPU, and every CUDA device when there
is one). Sampling in sluice is seeded per sample and does not read these, but shuffles, dropout
or a user's reward may, and a resumed run must continue their streams where they stopped. The
state is plain data (lists of ints, strings, floats): JSON can hold it and
``torch.load(weights_only=True)`` reads it back. It does not decide when to capture them or where
they are stored.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """Every generator's state of this process, as plain lists, strings and numbers."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys).tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every generator to ``capture_rng``'s state."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes(s) for s in state["cuda"]])


def _bytes(values: Any) -> torch.Tensor:
    """A generator state as torch keeps it (a uint8 tensor), from a list or an older tensor."""
    return torch.as_tensor(values, dtype=torch.uint8)
