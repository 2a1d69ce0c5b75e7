"""``CodeExecReward``: run the response's Python code against the row's tests in the sandbox.

The program is the response's last fenced code block (```` ```python ... ``` ````, or the whole
response when it has none) followed by the row's ``tests`` field (e.g. ``assert`` statements).
The reward is 1.0 when that program exits cleanly within the sandbox's limits, else 0.0: a
wrong answer, a crash, a timeout or a limit hit are all just "failed", never a reward error.
Sandboxing itself (limits, no network, private directory) lives in ``sandbox.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sluice.rewards.sandbox import SandboxLimits, run_sandboxed

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, or all of it when there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


@dataclass(frozen=True)
class CodeExecReward:
    """A picklable reward: ``reward(response, tests=...) -> 1.0 | 0.0``."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)

    def __call__(self, response: str, *, tests: str, **_: Any) -> float:
        program = f"{extract_code(response)}\n\n{tests}\n"
        return 1.0 if run_sandboxed(program, self.limits).status == "ok" else 0.0
