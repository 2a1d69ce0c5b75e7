"""What a built-in task is: data generators, reward, the tiny model shape and its SFT recipe.

A task is a frozen ``TaskSpec`` value registered in ``sluice.tasks.TASKS`` (a plain dict). It
holds no state and runs nothing; ``tasks/base_model.py`` builds the cached base model from it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sluice.api import RewardFn


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the tiny model; the vocabulary is padded up to a multiple of 8."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 384
    max_position_embeddings: int = 128


@dataclass(frozen=True)
class SftRecipe:
    """How the embedded default's base model is warm-started."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 20


@dataclass(frozen=True)
class TaskSpec:
    """A verifiable task with a generated dataset.

    ``make_row(rng)`` draws one row ``{"prompt", "answer", "bucket", ...}``;
    ``demonstrate(row, rng)`` returns the SFT target shown for that row (noisy on purpose for
    some tasks, so that RL has headroom); ``reward(response, **row_fields)`` scores a response.
    """

    name: str
    alphabet: str
    reward: RewardFn
    max_new_tokens: int
    make_row: Callable[[random.Random], dict[str, Any]]
    demonstrate: Callable[[dict[str, Any], random.Random], str]
    model: TinyLlamaSpec = field(default_factory=TinyLlamaSpec)
    sft: SftRecipe = field(default_factory=lambda: SftRecipe(steps=150, batch_size=64, lr=1e-3))
    eval_seed: int = 12345
    revision: int = 1
    """Bump whenever ``make_row`` / ``demonstrate`` change: it keys the cached base model."""
    description: str = ""
    env: str | None = None
    """Multi-turn tasks: the environment (``sluice.rollout.envs.ENVS``) that plays a row's episode;
    rows are then its reset options and its reward is the episode's."""
    demonstrate_turn: Callable[[dict[str, Any], random.Random], tuple[str, str]] | None = None
    """Multi-turn tasks: (conversation so far, next model turn) of a demonstrated episode of the
    row, what the warm start imitates instead of (``prompt``, ``demonstrate``)."""


def generate_rows(
    task: TaskSpec, count: int, seed: int, exclude: set[str] | frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """``count`` rows drawn with ``random.Random(seed)``, skipping prompts in ``exclude``."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise ValueError(f"task {task.name}: cannot draw {count} rows outside the excluded set")
        row = task.make_row(rng)
        if row["prompt"] not in exclude:
            rows.append(row)
    return rows


def eval_rows(task: TaskSpec, count: int) -> list[dict[str, Any]]:
    """The fixed held-out set: distinct prompts drawn with the task's ``eval_seed``."""
    rng = random.Random(task.eval_seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < count:
        row = task.make_row(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows
