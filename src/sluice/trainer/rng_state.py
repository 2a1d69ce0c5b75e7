"""The random number generators of one process, captured and restored for a checkpoint.

Python's ``random``, NumPy's global generator and torch's (CPU, and every CUDA device when there
is one). Sampling in sluice is seeded per sample and does not read these, but shuffles, dropout
or a user's reward may, and a resumed run must continue their streams where they stopped. It
does not decide when to capture them or where they are stored.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """Plain picklable state of every generator of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every generator to ``capture_rng``'s state."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
