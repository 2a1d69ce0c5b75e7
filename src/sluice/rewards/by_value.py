"""Rewards that do not pickle by reference travel to the reward pool's processes by value.

A TRL user writes the reward in their own script, often as a closure over a local variable or
a lambda; plain pickle sends functions by name and refuses those. ``shippable(fn)`` returns
``fn`` itself when pickle takes it, else a ``ByValueReward`` holding the function serialised
with cloudpickle (Ray's vendored copy: no new dependency), which each pool process loads once.
A function cloudpickle cannot take either is refused with one line naming the fix
(``reward.pool_size=0`` runs it in this process). This module does not call rewards
(``pool.py``) nor judge them (``service.py``).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice.config import ConfigError


@dataclass(frozen=True)
class ByValueReward:
    """A reward function carried as cloudpickle bytes; called like the function itself."""

    data: bytes
    name: str

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, response: str, **fields: Any) -> Any:
        return _loaded(self.data)(response, **fields)


@functools.lru_cache(maxsize=16)
def _loaded(data: bytes) -> Callable[..., Any]:
    """The function, once per process (cloudpickle's output loads with plain pickle)."""
    fn: Callable[..., Any] = pickle.loads(data)
    return fn


def shippable(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` as the pool can send it: itself when it pickles by reference, else by value."""
    try:
        pickle.dumps(fn)
        return fn
    except Exception:  # deliberate: whatever plain pickle refuses, cloudpickle may take
        pass
    from ray import cloudpickle

    try:
        return ByValueReward(cloudpickle.dumps(fn), name)
    except Exception as err:  # deliberate: one line instead of a pickling traceback
        raise ConfigError(
            f"reward {name!r} cannot be sent to the reward pool's processes ({type(err).__name__}: {err}); "
            "set reward.pool_size=0 to run it in this process"
        ) from None
