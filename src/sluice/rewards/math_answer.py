"""``math_verify_reward``: is the response's final answer mathematically equal to the reference?

It delegates parsing (LaTeX, ``\\boxed{}``, plain expressions) and equivalence checking (sympy)
to Hugging Face's ``math-verify`` package, an optional extra (``pip install sluice[math]``);
importing this module does not need it, calling the reward does. Its own signal-based timeouts
are switched off because they only work on a process's main thread: the reward service's
per-call timeout bounds it instead.
"""

from __future__ import annotations

import logging
from typing import Any

from sluice.rewards.answers import answer_text

# math-verify warns on every call that its own timeout is disabled; the service times calls out.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def math_verify_reward(response: str, *, answer: Any, **_: Any) -> float:
    """1.0 when the last answer in ``response`` equals ``answer`` (a LaTeX or plain expression,
    e.g. ``"\\\\frac{1}{2}"``, ``"0.5"`` or the number ``42``) up to mathematical equivalence, else 0.0."""
    text = answer_text(answer)
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError("the math_verify reward needs the math extra: pip install 'sluice[math]'") from exc
    gold = parse(text, parsing_timeout=None) or parse(f"${text}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify reward: cannot parse the reference answer {text!r}")
    predicted = parse(response, parsing_timeout=None)
    return 1.0 if predicted and verify(gold, predicted, timeout_seconds=None) else 0.0
