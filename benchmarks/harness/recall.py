"""How well a length ranker finds the long tail, for the benchmarks and the ranker tests:
``top_share_recall``, the metric StreamRL reports for its ranker (Table 4). Nothing here ranks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def top_share_recall(predicted: Sequence[float], actual: Sequence[float], share: float = 0.2, seed: int = 0) -> float:
    """|predicted top share ∩ true top share| / |true top share| (StreamRL Table 4's recall).

    Lengths are integers with many ties; ties on either side are broken at random (``seed``),
    so a ranker that predicts one constant scores ``share`` in expectation, like a random one.
    """
    if len(predicted) != len(actual) or not actual:
        raise ValueError(f"need equally many predictions and lengths, got {len(predicted)} and {len(actual)}")
    k = math.ceil(share * len(actual))
    rng = random.Random(seed)
    jitter = [rng.random() for _ in actual]
    top = set(sorted(range(len(actual)), key=lambda i: (-actual[i], jitter[i]))[:k])
    rng.shuffle(jitter)
    guessed = sorted(range(len(predicted)), key=lambda i: (-predicted[i], jitter[i]))[:k]
    return len(top.intersection(guessed)) / k
