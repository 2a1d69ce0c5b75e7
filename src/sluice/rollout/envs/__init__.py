"""Built-in environments and the lookup of user ones by import path.

``ENVS`` maps a name to an env class (a plain dict: a new built-in is a file plus an entry);
``env_factory("pkg.module:MyEnv", kwargs)`` loads a user's class the same way. A factory makes
one fresh instance per episode. ``TINY_CHAT`` is the chat format of the embedded tiny
character-level models, and ``TINY_CHAT_TEMPLATE`` the same format as a Jinja chat template (for
agents that send OpenAI-style messages: ``rollout/agent_endpoint.py``).
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

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(first=true) %}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}>{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] or [] %}c{{ call['function']['arguments']['expression'] }}{% endfor %}"
    "{{ eos_token }}"
    "{% elif m['role'] != 'system' %}{{ '' if ns.first else '|' }}{{ m['content'] }}{% set ns.first = false %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)
"""``TINY_CHAT`` as a chat template: the first user (or tool) message as it is, each later one
after ``|``, an assistant turn as ``>`` · its text · its calculator calls (``c<expression>``, from a
call's ``arguments.expression``) · ``<eos>``; ``>`` opens the turn to generate. System messages are
not shown (the tiny models were never trained on one)."""


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


__all__ = ["ENVS", "TINY_CHAT", "TINY_CHAT_TEMPLATE", "CalculatorEnv", "GuessNumberEnv", "env_factory"]
