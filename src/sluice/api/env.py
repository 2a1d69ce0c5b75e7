"""The environment seam of agentic multi-turn RL: ``Env`` (async, gym-like, text in / text out).

An environment turns the model's action text into the next observation, a reward and a done
flag. It knows nothing about tokens, engines or queues: ``rollout/env_runner.py`` drives it,
``rollout/trajectory.py`` turns the conversation into training tokens. User environments are
classes named by import path (``rollout/envs/__init__.py``); built-ins live beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EnvStep:
    """What ``Env.step`` returns: the next observation (shown to the model unless ``done``), the
    reward of this step, whether the episode ended, and free-form diagnostics."""

    observation: str
    reward: float
    done: bool
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """One environment instance; a runner uses it for one episode at a time."""

    async def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> str:
        """Start an episode; ``options`` are the dataset row's fields. Returns the first observation."""
        ...

    async def step(self, action: str) -> EnvStep:
        """Apply the model's decoded turn."""
        ...

    async def close(self) -> None:
        """Release what the instance holds (processes, sockets); it is not used again."""
        ...


@runtime_checkable
class ToolEnv(Env, Protocol):
    """An ``Env`` whose actions may call tools: the schema (JSON-schema style dicts, one per tool)
    is rendered into the first prompt by the chat format."""

    def tools(self) -> Sequence[Mapping[str, Any]]: ...
