"""Rule-based rewards that compare the decoded response with a reference ``answer`` field.

They are plain functions (the ``RewardFn`` contract). They do not decode tokens or strip special
tokens: the workflow hands them clean text.
"""

from __future__ import annotations

from typing import Any


def exact_match_reward(response: str, *, answer: str, **_: Any) -> float:
    """1.0 when the response equals the reference answer after stripping whitespace, else 0.0."""
    return 1.0 if response.strip() == str(answer).strip() else 0.0
