"""Training throughput by micro-batch layout on the default task's long-tailed data.

One GRPO step is 32 groups × 8 samples of the reverse-digits task (prompts from the task's
generator, responses the answer plus ``<eos>``, so lengths have the default run's long tail),
trained with forward + backward on the default tiny model shape, one thread. Variants, each the
same samples and the same number of micro-batches:

- ``random-padded``: samples in random order, each micro-batch padded to its own longest row
  (the naive baseline the training issue compares against);
- ``padded``: sluice's in-order micro-batches, length-sorted padded chunks;
- ``packed``: padding-free packed rows of several samples (``share_prompts`` off);
- ``packed+shared``: the default — rows of whole groups as long as the longest group, each
  group's prompt computed once;
- ``packed+shared 512``: the same with rows of up to 512 positions (fewer, longer rows).

Rounds interleave the variants so machine noise hits all of them alike; the median step time
of the rounds is reported. ``positions/token`` is model positions computed per sample token
(prompt + response): above 1 is padding, below 1 is prompt sharing. Prints a table, writes JSON.

``strategies`` instead measures the trainer's strategies and dtypes (``harness/strategies.py``):
for 1 / 2 ranks × {ddp, fsdp2} and single-rank float32 vs bfloat16, on the tiny model shape and a
wider one, the bytes of parameters, gradients and optimizer state each rank holds after one step,
and the step time.

    .venv/bin/python benchmarks/training.py [--steps 3] [--rounds 3]
    .venv/bin/python benchmarks/training.py strategies [--steps 3]   # writes training_strategies.json
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch
from harness.report import write_results
from harness.strategies import SHAPES, measure, print_table

from sluice.api.types import MicroBatch, Sample
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.packing import family_tokens, prompt_families
from sluice.tasks import TASKS
from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.step import plan_step

VARIANTS = {
    "random-padded": {"layout": "padded", "padded_token_budget": 10**9},
    "padded": {"layout": "padded"},
    "packed": {"layout": "packed", "share_prompts": False},
    "packed+shared": {"layout": "packed", "share_prompts": True},
    "packed+shared 512": {"layout": "packed", "share_prompts": True, "pack_row_tokens": 512},
}


def _steps(steps: int, groups: int, group_size: int, seed: int) -> list[list[Sample]]:
    task = TASKS["reverse_digits"]
    tok = build_char_tokenizer(task.alphabet)
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        samples = []
        for g in range(groups):
            row = task.make_row(rng)
            prompt = tuple(tok(row["prompt"])["input_ids"])
            for k in range(group_size):
                answer = row["answer"] if rng.random() < 0.6 else "-" + row["answer"]
                resp = (*tok(answer, add_special_tokens=False)["input_ids"], tok.eos_token_id)
                n, reward, uid = len(resp), float(rng.random() < 0.5), f"{step}-{g}-{k}"
                samples.append(Sample(uid, step * groups + g, prompt, resp, (-1.0,) * n, (0,) * n, (1,) * n, reward))
        out.append(samples)
    return out


def _micro_batches(samples: list[Sample], algorithm: GRPOAlgorithm, budget: int, shuffle: bool) -> list[MicroBatch]:
    planned = plan_step(samples, algorithm, budget)
    if not shuffle:
        return planned
    rng = random.Random(0)
    flat = [(s, a, p) for mb in planned for s, a, p in zip(mb.samples, mb.advantages, mb.prox_logprobs, strict=True)]
    rng.shuffle(flat)
    cuts = [0]
    for mb in planned:
        cuts.append(cuts[-1] + len(mb.samples))
    return [
        MicroBatch(tuple(x[0] for x in part), tuple(x[1] for x in part), tuple(x[2] for x in part), 1.0)
        for part in (flat[a:b] for a, b in itertools.pairwise(cuts))
    ]


def _positions(engine: HFTrainEngine, mbs: list[MicroBatch]) -> tuple[int, int]:
    """(positions computed, of which padding) over a step's forwards."""
    computed = padding = 0
    for mb in mbs:
        for rows in engine.plan_forwards(mb.samples, engine.padded_token_budget):
            samples = [[mb.samples[i] for i in row] for row in rows]
            width = engine.forward_inputs(samples)["input_ids"].shape[1]
            for row in samples:
                families = prompt_families(row, engine.share_prompts) if engine.layout == "packed" else [[0]]
                real = sum(family_tokens(row, f) for f in families) if engine.layout == "packed" else row[0].num_tokens
                computed += width
                padding += width - real
    return computed, padding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", nargs="?", default="layouts", choices=("layouts", "strategies"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/training[_strategies].json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.table == "strategies":
        rows = [row for shape in SHAPES for row in measure(shape, _steps(args.steps, groups=16, group_size=8, seed=1))]
        print_table(rows)
        write_results(args.out or "benchmarks/results/training_strategies.json", args, rows)
        return
    args.out = args.out or "benchmarks/results/training.json"
    task = TASKS["reverse_digits"]
    model = build_tiny_llama(task.model, build_char_tokenizer(task.alphabet), seed=0)
    algorithm = GRPOAlgorithm()
    steps = _steps(args.steps, groups=32, group_size=8, seed=1)
    engines = {name: HFTrainEngine(model, lr=1e-4, **kw) for name, kw in VARIANTS.items()}
    plans = {
        name: [_micro_batches(s, algorithm, args.micro_batch_tokens, shuffle=name == "random-padded") for s in steps]
        for name in VARIANTS
    }
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            for mbs in plans[name]:
                engine.begin_step()  # gradients only: no optimizer step, so every variant sees the same weights
                for mb in mbs:
                    engine.accumulate(mb, algorithm)
            times[name].append((time.perf_counter() - start) / len(steps))
    sample_tokens = sum(s.num_tokens for step in steps for s in step) / len(steps)
    response_tokens = sum(len(s.response_ids) for step in steps for s in step) / len(steps)
    rows = []
    for name, engine in engines.items():
        step_s = statistics.median(times[name])
        counted = [_positions(engine, mbs) for mbs in plans[name]]
        positions = sum(c for c, _ in counted) / len(steps)
        padding = sum(p for _, p in counted) / len(steps)
        rows.append({
            "variant": name, "micro_batches": len(plans[name][0]), "step_s": round(step_s, 4),
            "tokens_per_s": round(sample_tokens / step_s, 1),
            "response_tokens_per_s": round(response_tokens / step_s, 1),
            "positions_per_token": round(positions / sample_tokens, 3),
            "padding_fraction": round(padding / positions, 3), "rounds_s": [round(t, 4) for t in times[name]],
        })  # fmt: skip
    base = rows[0]["tokens_per_s"]
    print(f"{sample_tokens:.0f} tokens ({response_tokens:.0f} response) per step, {args.threads} thread(s)")
    print(f"{'variant':<19} {'mbs':>4} {'step s':>7} {'tok/s':>8} {'vs random':>9} {'pos/token':>9} {'padding':>8}")
    for r in rows:
        print(
            f"{r['variant']:<19} {r['micro_batches']:>4} {r['step_s']:>7.3f} {r['tokens_per_s']:>8.0f} "
            f"{r['tokens_per_s'] / base:>8.2f}x {r['positions_per_token']:>9.2f} {r['padding_fraction']:>8.1%}"
        )
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
