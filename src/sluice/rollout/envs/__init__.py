"""Built-in environments and the lookup of user ones by import path.

``ENVS`` maps a name to an env class (a plain dict: a new built-in is a file plus an entry);
``env_factory("pkg.module:MyEnv", kwargs)`` loads a user's class the same way. A factory makes
one fresh instance per episode. ``TINY_CHAT`` is the chat format of the embedded tiny
character-level models (their tokenizer has no chat template).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from sluice.api import Env
from sluice.rollout.envs.calculator import CalculatorEnv
from sluice.rollout.envs.guess_number import GuessNumberEnv
from sluice.rollout.trajectory import ChatFormat

ENVS: dict[str, Callable[..., Env]] = {"calculator": CalculatorEnv, "guess_number": GuessNumberEnv}

TINY_CHAT = ChatFormat(first="{observation}>", observation="|{observation}>", turn_end="<eos>")
"""``37*48>`` · model turn · ``<eos>`` · ``|1776>`` · model turn · ``<eos>`` …"""


def env_factory(name: str, kwargs: Mapping[str, Any] | None = None) -> Callable[[], Env]:
    """A zero-argument factory of ``name`` (a key of ``ENVS`` or ``module:Class``) with ``kwargs``."""
    if name in ENVS:
        cls = ENVS[name]
    elif ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"agentic.env: cannot load {name!r} ({err})") from err
    else:
        raise ValueError(f"agentic.env: unknown env {name!r}; built-in: {', '.join(ENVS)}, or 'module:Class'")
    return functools.partial(cls, **dict(kwargs or {}))


__all__ = ["ENVS", "TINY_CHAT", "CalculatorEnv", "GuessNumberEnv", "env_factory"]
