"""Rule-based rewards that compare the decoded response with a reference ``answer`` field.

They are plain functions (the ``RewardFn`` contract). They do not decode tokens or strip special
tokens: the workflow hands them clean text.
"""

from __future__ import annotations

from typing import Any

from sluice.rewards.answers import answer_text


def exact_match_reward(response: str, *, answer: Any, **_: Any) -> float:
    """1.0 when the response equals the reference answer (a string or number, as text) after
    stripping whitespace, else 0.0."""
    return 1.0 if response.strip() == answer_text(answer).strip() else 0.0
