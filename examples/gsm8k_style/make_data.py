"""Synthetic grade-school word problems in verl's parquet schema: ``train.parquet`` and ``test.parquet``.

Five templates (shopping with change, ages, distance at a speed, sharing equally, a multi-step
marble count), small integers, integer answers, each with a short worked solution of two or three
arithmetic steps ending in ``\\boxed{answer}``. Deterministic for a given seed; the test split's
prompts are disjoint from the train split's. It downloads nothing and trains nothing
(``make_model.py`` builds the model from ``train.parquet``).

    python examples/gsm8k_style/make_data.py --out examples/gsm8k_style/data

Each row: ``data_source`` ("gsm8k_style"), ``prompt`` (chat messages: one user turn, the question
plus an instruction to box the answer), ``ability`` ("math"), ``reward_model``
(``{"style": "rule", "ground_truth": "<answer>"}``) and ``extra_info`` (``{"split", "index",
"answer": worked solution, "template"}``).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "gsm8k_style"
INSTRUCTION = "Let's think step by step and put the final answer in \\boxed{}."
NAMES = ("Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lea", "Max", "Nia", "Omar")
ITEMS = ("pencils", "apples", "stickers", "books", "cups", "balls", "cards", "pens")
TREATS = ("cookies", "candies", "grapes", "nuts", "muffins")

Problem = tuple[str, list[str], int]
"""(question, worked steps, answer)."""


def _shopping(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(2, 9)
    cost = count * price
    bill = rng.choice([b for b in (20, 50, 100) if b > cost])
    question = (
        f"{name} buys {count} {item} that cost {price} dollars each and pays with a {bill} dollar bill. "
        f"How much change does {name} get?"
    )
    steps = [f"The {item} cost {count} * {price} = {cost} dollars.", f"The change is {bill} - {cost} = {bill - cost}."]
    return question, steps, bill - cost


def _ages(rng: random.Random) -> Problem:
    a, b = rng.sample(NAMES, 2)
    age, gap, later = rng.randint(3, 40), rng.randint(2, 30), rng.randint(2, 20)
    question = f"{a} is {age} years old. {b} is {gap} years older than {a}. How old will {b} be in {later} years?"
    steps = [
        f"{b} is {age} + {gap} = {age + gap} years old.",
        f"In {later} years {b} will be {age + gap} + {later} = {age + gap + later}.",
    ]
    return question, steps, age + gap + later


def _distance(rng: random.Random) -> Problem:
    vehicle = rng.choice(("train", "car", "bus", "bike"))
    speed, hours, extra = rng.randint(2, 12) * 5, rng.randint(2, 6), rng.randint(3, 40)
    first = speed * hours
    question = (
        f"A {vehicle} travels at {speed} km per hour for {hours} hours and then drives {extra} more km. "
        f"How many km does it travel in total?"
    )
    steps = [
        f"First it travels {speed} * {hours} = {first} km.",
        f"In total it travels {first} + {extra} = {first + extra} km.",
    ]
    return question, steps, first + extra


def _sharing(rng: random.Random) -> Problem:
    name, treat = rng.choice(NAMES), rng.choice(TREATS)
    friends, each, eaten = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 3)
    total = friends * each
    question = (
        f"{name} has {total} {treat} and shares them equally among {friends} friends. "
        f"Each friend eats {eaten} of them. How many {treat} does each friend have left?"
    )
    steps = [
        f"Each friend gets {total} / {friends} = {each} {treat}.",
        f"Each friend has {each} - {eaten} = {each - eaten} left.",
    ]
    return question, steps, each - eaten


def _marbles(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    start, found, lost = rng.randint(5, 40), rng.randint(2, 30), rng.randint(1, 20)
    packs, per_pack = rng.randint(2, 5), rng.randint(2, 6)
    after, bought = start + found - lost, packs * per_pack
    question = (
        f"{name} has {start} marbles, finds {found} more and then loses {lost}. "
        f"Then {name} buys {packs} bags with {per_pack} marbles in each bag. How many marbles does {name} have now?"
    )
    steps = [
        f"{name} has {start} + {found} = {start + found}, then {start + found} - {lost} = {after}.",
        f"The bags hold {packs} * {per_pack} = {bought} marbles.",
        f"{name} has {after} + {bought} = {after + bought} marbles.",
    ]
    return question, steps, after + bought


TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    "shopping": _shopping,
    "ages": _ages,
    "distance": _distance,
    "sharing": _sharing,
    "marbles": _marbles,
}


def solution_text(steps: list[str], answer: int) -> str:
    """The worked solution a model is taught to write: the steps, then the boxed answer."""
    return " ".join(steps) + f" The answer is \\boxed{{{answer}}}."


def draw_problems(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` problems with distinct questions, templates in turn, from ``random.Random(seed)``."""
    rng = random.Random(seed)
    names = list(TEMPLATES)
    seen: set[str] = set()
    problems: list[dict[str, Any]] = []
    while len(problems) < count:
        template = names[len(problems) % len(names)]
        question, steps, answer = TEMPLATES[template](rng)
        if question in seen:
            continue
        seen.add(question)
        problems.append({"template": template, "question": question, "steps": steps, "answer": answer})
    return problems


def to_verl_row(problem: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """One row of verl's parquet schema."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem["answer"])},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": solution_text(problem["steps"], problem["answer"]),
            "template": problem["template"],
        },
    }


def make_splits(train: int, test: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and test rows with disjoint questions: one stream of distinct problems, shuffled, split."""
    problems = draw_problems(train + test, seed)
    random.Random(seed + 1).shuffle(problems)
    train_rows = [to_verl_row(p, "train", i) for i, p in enumerate(problems[:train])]
    test_rows = [to_verl_row(p, "test", i) for i, p in enumerate(problems[train:])]
    return train_rows, test_rows


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_dataset(out: Path, train: int, test: int, seed: int) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out``; returns their paths."""
    train_rows, test_rows = make_splits(train, test, seed)
    paths = out / "train.parquet", out / "test.parquet"
    write_parquet(train_rows, paths[0])
    write_parquet(test_rows, paths[1])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data", help="output folder")
    parser.add_argument("--train", type=int, default=4000, help="training rows")
    parser.add_argument("--test", type=int, default=500, help="held-out rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    paths = write_dataset(args.out, args.train, args.test, args.seed)
    print(f"wrote {args.train} + {args.test} rows to {paths[0]}, {paths[1]} in {time.perf_counter() - started:.2f}s")


if __name__ == "__main__":
    main()
