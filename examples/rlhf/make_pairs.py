"""Build what the RLHF example starts from: the built-in task's warm-started base model (linked as
``examples/rlhf/base``) and preference pairs whose hidden rule the reward model must learn.

    python examples/rlhf/make_pairs.py            # -> examples/rlhf/base, examples/rlhf/data/pairs_{train,val}.jsonl

The task is the built-in ``reverse_digits`` (prompt ``"<digits>>"``). The hidden rule: a good
answer is the digits exactly reversed, with nothing before them. The pairs never state it: each
row is TRL's plain-text preference schema ``{"prompt", "chosen", "rejected"}`` with the correct
answer chosen and a near miss rejected: the ``-`` prefix the base model's demonstrations taught it
(``tasks/reverse_digits.py``), one digit changed, two neighbouring digits swapped, the digits not
reversed, the answer cut short, or digits after it (the last one repeated, or any: without these
the policy found that the reward model paid for them; README.md). Prompts are drawn with their own
seed and never from the task's held-out set, on which ``sluice train`` measures the rule (exact
match) that the policy's reward (the reward model alone) never sees. It trains nothing and downloads nothing.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from sluice.tasks import TASKS
from sluice.tasks.base_model import ensure_base_model
from sluice.tasks.spec import eval_rows

HERE = Path(__file__).parent
TASK = TASKS["reverse_digits"]


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to ``answer`` (never equal to it)."""
    while True:
        kind = rng.choices(["prefix", "digit", "swap", "unreversed", "short", "long"], [4, 2, 2, 1, 1, 2])[0]
        out = answer
        if kind == "prefix":
            out = "-" + answer
        elif kind == "digit":
            k = rng.randrange(len(answer))
            out = answer[:k] + rng.choice([d for d in "0123456789" if d != answer[k]]) + answer[k + 1 :]
        elif kind == "swap":
            k = rng.randrange(len(answer) - 1)
            out = answer[:k] + answer[k + 1] + answer[k] + answer[k + 2 :]
        elif kind == "unreversed":
            out = answer[::-1]
        elif kind == "short" and len(answer) > 1:
            out = answer[: rng.randrange(1, len(answer))]
        elif kind == "long":  # digits after the answer: the last one repeated, or any
            extra = rng.randint(1, 4)
            out = answer + (answer[-1] * extra if rng.random() < 0.5 else "".join(rng.choices("0123456789", k=extra)))
        if out != answer:
            return out


def pairs(count: int, seed: int, exclude: set[str]) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    while len(rows) < count:
        row = TASK.make_row(rng)
        if row["prompt"] not in exclude:
            rows.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": near_miss(row["answer"], rng)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--val", type=int, default=500)
    parser.add_argument("--cache-dir", default=".cache/sluice", help="model.cache_dir of sluice train")
    args = parser.parse_args()
    base = ensure_base_model(TASK, args.cache_dir, seed=0, eval_count=500)  # what `sluice train` builds
    link = HERE / "base"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(base.resolve())
    held_out = {r["prompt"] for r in eval_rows(TASK, 500)}
    data = HERE / "data"
    data.mkdir(exist_ok=True)
    train = pairs(args.train, 101, held_out)
    val = pairs(args.val, 202, held_out | {r["prompt"] for r in train})
    for name, rows in (("pairs_train", train), ("pairs_val", val)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"base model {link} -> {base}; {len(train)} train / {len(val)} val pairs in {data}")


if __name__ == "__main__":
    main()
