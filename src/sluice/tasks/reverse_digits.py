"""The embedded default task: reverse a string of digits, warm-started from noisy demonstrations.

Prompt ``"<digits>>"``, answer the digits reversed; the reward is exact match. Input lengths are
long-tailed (70 % of 3–6 digits, 30 % of 10–26), so answer lengths are too (held-out
p99/p50 = 4.5): the regime where asynchronous rollout pays.

The SFT demonstrations are deliberately noisy: some answers carry a spurious ``-`` prefix (a
"distractor convention"), more often when the answer starts with a low digit. The warm-started
model therefore *can* produce the right answer (high pass@k) but greedy decoding often
follows the distractor: headroom that GRPO turns into greedy accuracy. See
``docs/learning_spike.md`` for how this recipe was chosen.
"""

from __future__ import annotations

import random
from typing import Any

from sluice.rewards import exact_match_reward
from sluice.tasks.spec import SftRecipe, TaskSpec, TinyLlamaSpec

SHORT_SHARE = 0.7
SHORT_LENGTHS = (3, 6)
LONG_LENGTHS = (10, 26)
DISTRACTOR = "-"
NOISE_LOW_DIGIT = 0.7
"""Share of demonstrations with the distractor when the answer starts with a digit below 7."""
NOISE_HIGH_DIGIT = 0.3
"""Share of demonstrations with the distractor when the answer starts with 7, 8 or 9."""


def make_row(rng: random.Random) -> dict[str, Any]:
    lo, hi = SHORT_LENGTHS if rng.random() < SHORT_SHARE else LONG_LENGTHS
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))
    return {
        "prompt": digits + ">",
        "answer": digits[::-1],
        "bucket": "short" if len(digits) <= SHORT_LENGTHS[1] else "long",
    }


def demonstrate(row: dict[str, Any], rng: random.Random) -> str:
    answer = row["answer"]
    noise = NOISE_LOW_DIGIT if int(answer[0]) < 7 else NOISE_HIGH_DIGIT
    return DISTRACTOR + answer if rng.random() < noise else answer


REVERSE_DIGITS = TaskSpec(
    name="reverse_digits",
    alphabet="0123456789>" + DISTRACTOR,
    reward=exact_match_reward,
    max_new_tokens=LONG_LENGTHS[1] + 3,  # the longest answer, its <eos>, and slack
    make_row=make_row,
    demonstrate=demonstrate,
    model=TinyLlamaSpec(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=384,
        max_position_embeddings=128,
    ),
    sft=SftRecipe(steps=300, batch_size=64, lr=2e-3, warmup_steps=20),
    revision=2,
    description="reverse a digit string; long-tailed lengths; noisy SFT demonstrations",
)
