"""``CalculatorEnv``: a tool-use task — multiply two numbers, with a calculator the model must call.

The first observation is the problem (``37*48``). The model either calls the calculator with
``c<expression>`` (``c37*48``; it answers with the value, ``1776``, or ``err``) or answers with
``a<number>``, which ends the episode: reward 1 if the number is the product, else 0. Anything
else ends the episode with reward 0. A tiny model cannot multiply two-digit numbers in its head;
it can learn to call the tool and copy its answer. The task's warm-start demonstrations call the
tool only sometimes (``calculator_task`` in ``tasks/agentic.py``), which is the headroom RL closes.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.api import EnvStep

_EXPRESSION = re.compile(r"^(\d{1,4})([*+-])(\d{1,4})$")
TOOL = {"name": "c", "description": "calculator: c<a><op><b> with op in * + -", "parameters": {"expression": "str"}}


def problem(seed: int) -> tuple[int, int]:
    """The operands of episode ``seed`` (two-digit numbers)."""
    rng = random.Random(seed)
    return rng.randint(10, 99), rng.randint(10, 99)


def calculate(expression: str) -> str:
    """The calculator tool: the value of ``a*b``, ``a+b`` or ``a-b``, or ``err``."""
    match = _EXPRESSION.match(expression)
    if match is None:
        return "err"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


class CalculatorEnv:
    """See the module docstring. Reset options ``a`` and ``b`` fix the problem; else ``seed`` does."""

    def __init__(self) -> None:
        self.a = self.b = 0
        self.tool_calls = 0

    async def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> str:
        options = options or {}
        self.a, self.b = (int(options["a"]), int(options["b"])) if "a" in options else problem(seed)
        self.tool_calls = 0
        return f"{self.a}*{self.b}"

    async def step(self, action: str) -> EnvStep:
        if action.startswith("c"):
            self.tool_calls += 1
            return EnvStep(calculate(action[1:]), 0.0, False, {"tool_calls": self.tool_calls})
        correct = action.startswith("a") and action[1:] == str(self.a * self.b)
        return EnvStep("", float(correct), True, {"tool_calls": self.tool_calls})

    def tools(self) -> Sequence[Mapping[str, Any]]:
        return [TOOL]

    async def close(self) -> None:
        return None
