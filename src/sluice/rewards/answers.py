"""``answer_text``: a row's reference answer as the text the built-in rewards compare with.

Rows read from JSON or parquet carry answers as numbers as often as strings (``42``, ``0.5``,
``true``); the built-ins compare text, so a scalar becomes its ``str``. A list, dict or missing
answer is refused with a message naming the field rather than compared as its ``repr``. This
module does not parse or normalise maths: ``math_verify`` does.
"""

from __future__ import annotations

import numbers
from typing import Any


def answer_text(answer: Any, field: str = "answer") -> str:
    """``answer`` as text: a string as is, a number or bool as ``str``; anything else raises
    ``TypeError`` naming ``field``."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (numbers.Number, bool)):
        return str(answer)
    kind = "missing (None)" if answer is None else f"a {type(answer).__name__}, not a string or number"
    raise TypeError(f"reward field {field!r}: the reference answer is {kind}: {answer!r:.80}")
