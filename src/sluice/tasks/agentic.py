"""Built-in multi-turn tasks: a tool-use task (``calculator``) and a game (``guess_number``).

Each is a ``TaskSpec`` whose rows are episode settings for its environment
(``rollout/envs/``) and whose warm start imitates a scripted, deliberately imperfect policy one
turn at a time (``demonstrate_turn``: the conversation so far in ``TINY_CHAT``, then the next
model turn), so the SFT model lands at a 5–50 % success rate and RL has headroom:

- calculator: the demonstrations call the tool (``c37*48``, then copy its answer) only 20 % of
  the time when the first operand is below 70 and 65 % otherwise; else they answer a wrong guess
  (so greedy decoding calls the tool on about a third of the problems);
- guess_number: each demonstrated guess is the midpoint of the numbers the hints still allow
  with probability 0.4, else a uniform guess over the whole range.
"""

from __future__ import annotations

import random
from typing import Any

from sluice.rewards import exact_match_reward
from sluice.rollout.envs import TINY_CHAT
from sluice.rollout.envs.calculator import problem
from sluice.rollout.envs.guess_number import SPAN, secret
from sluice.tasks.spec import SftRecipe, TaskSpec, TinyLlamaSpec

TOOL_SHARE_LOW = 0.2
"""Share of calculator demonstrations that call the tool when the first operand is below ``TOOL_FROM``."""
TOOL_SHARE_HIGH = 0.65
TOOL_FROM = 70
BINARY_SHARE = 0.4
"""Share of demonstrated guesses that halve the remaining range."""
MAX_GUESSES = 4


def _turn_of(first: str, turns: list[tuple[str, str | None]], k: int) -> tuple[str, str]:
    """(the conversation before model turn ``k``, that turn's text)."""
    return TINY_CHAT.render(first, turns[:k]), turns[k][0]


def calculator_row(rng: random.Random) -> dict[str, Any]:
    a, b = problem(rng.randrange(1 << 30))
    return {"prompt": f"{a}*{b}", "answer": str(a * b), "a": a, "b": b}


def calculator_turn(row: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """Half the examples are first turns (tool call or guess, at the task's shares), half are
    the answer after a tool result (copy it)."""
    a, b, product = row["a"], row["b"], row["a"] * row["b"]
    tool = [(f"c{a}*{b}", str(product)), (f"a{product}", None)]
    if rng.random() < 0.5:
        return _turn_of(row["prompt"], tool, 1)
    if rng.random() < (TOOL_SHARE_LOW if a < TOOL_FROM else TOOL_SHARE_HIGH):
        return _turn_of(row["prompt"], tool, 0)
    guess = product + rng.choice([-1, 1]) * rng.randint(1, max(product // 10, 1))
    return _turn_of(row["prompt"], [(f"a{guess}", None)], 0)


def guess_row(rng: random.Random) -> dict[str, Any]:
    seed = rng.randrange(1 << 30)
    lo, target = secret(seed)
    return {"prompt": f"{lo}-{lo + SPAN - 1}#{seed}", "answer": str(target), "seed": seed, "lo": lo, "target": target}


def guess_episode(row: dict[str, Any], rng: random.Random) -> list[tuple[str, str | None]]:
    """A scripted game: midpoint guesses with probability ``BINARY_SHARE``, else uniform ones."""
    lo, target = row["lo"], row["target"]
    low, high = lo, lo + SPAN - 1
    turns: list[tuple[str, str | None]] = []
    for _ in range(MAX_GUESSES):
        guess = (low + high) // 2 if rng.random() < BINARY_SHARE else rng.randint(lo, lo + SPAN - 1)
        if guess == target:
            turns.append((f"g{guess}", None))
            break
        hint = "h" if target > guess else "l"
        low, high = (max(low, guess + 1), high) if hint == "h" else (low, min(high, guess - 1))
        turns.append((f"g{guess}", hint))
    return turns


def guess_turn(row: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    turns = guess_episode(row, rng)
    return _turn_of(row["prompt"].split("#")[0], turns, rng.randrange(len(turns)))


TINY_AGENT = TinyLlamaSpec(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                           intermediate_size=384, max_position_embeddings=128)  # fmt: skip

CALCULATOR = TaskSpec(
    name="calculator",
    alphabet="0123456789*+-ac>|er",
    reward=exact_match_reward,
    max_new_tokens=12,
    make_row=calculator_row,
    demonstrate=lambda row, rng: calculator_turn(row, rng)[1],
    demonstrate_turn=calculator_turn,
    env="calculator",
    model=TINY_AGENT,
    sft=SftRecipe(steps=300, batch_size=64, lr=2e-3, warmup_steps=20),
    revision=2,
    description="multiply two numbers with a calculator tool the model must call (multi-turn)",
)

GUESS_NUMBER = TaskSpec(
    name="guess_number",
    alphabet="0123456789-#ghlx>|",
    reward=exact_match_reward,
    max_new_tokens=6,
    make_row=guess_row,
    demonstrate=lambda row, rng: guess_episode(row, rng)[0][0],
    demonstrate_turn=guess_turn,
    env="guess_number",
    model=TINY_AGENT,
    sft=SftRecipe(steps=400, batch_size=64, lr=2e-3, warmup_steps=20),
    revision=1,
    description="find a hidden number in 4 guesses from higher / lower hints (multi-turn game)",
)
