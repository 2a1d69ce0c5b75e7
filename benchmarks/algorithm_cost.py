"""Cost of the algorithm options per training step, relative to the default GRPO step.

One global batch of 32 groups × 8 samples (random tokens, long-tailed response lengths), on the
default tiny model shape, one thread. Each variant runs whole training steps
(``trainer/updates.py``; ``trainer/ppo.py`` for the critic) from the same weights:

- ``default``: one update, proximal = behaviour log-probs;
- ``prox recompute``: + one no-grad forward for the proximal log-probs (decoupled PPO);
- ``4 mini-batches``: + recompute, 4 optimizer updates per step;
- ``kl (k3, loss)``: + the reference step (a no-grad forward of the frozen model);
- ``entropy``: + per-token entropy of the full distribution, with grad;
- ``lora r=8``: adapters only (fewer parameters to update, same forwards);
- ``ppo + critic``: critic values, GAE, actor update, critic update.

Rounds interleave the variants so machine noise hits all of them alike; the median of the
rounds is reported with its ratio to ``default``. Prints a table, writes JSON.

    .venv/bin/python benchmarks/algorithm_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from harness.report import write_results

from sluice.api.types import Sample
from sluice.config import TrainerConfig
from sluice.engines.critic import CriticEngine
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.lora import LoraSpec
from sluice.tasks import TASKS
from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.rl_step import train_global_batch
from sluice.trainer.sections import frozen_engine
from sluice.trainer.updates import UpdateSchedule

MICRO_BATCH_TOKENS = 2048
ONE_UPDATE = UpdateSchedule()


def _batch(vocab: int, groups: int = 32, group_size: int = 8, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(1, vocab) for _ in range(rng.randint(4, 14)))
        for k in range(group_size):
            n = min(40, max(1, int(rng.paretovariate(1.5) * 4)))
            resp = tuple(rng.randrange(1, vocab) for _ in range(n))
            out.append(Sample(f"{g}-{k}", g, prompt, resp, (-2.0,) * n, (0,) * n, (1,) * n, float(rng.random() < 0.5)))
    return out


def _variants(model_dir: str, samples: list[Sample]) -> dict[str, Callable[[], None]]:
    def step(algorithm: GRPOAlgorithm, schedule: UpdateSchedule = ONE_UPDATE, **engine) -> Callable[[], None]:
        def run() -> None:
            actor = HFTrainEngine.from_pretrained(model_dir, lr=1e-4, **engine)
            batch = reference_logprobs(reference, samples, 1.0) if algorithm.uses_reference else samples
            train_global_batch(actor, batch, algorithm, MICRO_BATCH_TOKENS, schedule, 1.0)

        return run

    def ppo() -> None:
        actor = HFTrainEngine.from_pretrained(model_dir, lr=1e-4)
        critic = CriticEngine(model_dir, lr=1e-4)
        algorithm = GRPOAlgorithm(estimator="gae")
        train_global_batch(actor, samples, algorithm, MICRO_BATCH_TOKENS, UpdateSchedule(), 1.0, critic=critic)

    reference = frozen_engine(model_dir, TrainerConfig(), 1.0)
    return {
        "default": step(GRPOAlgorithm()),
        "prox recompute": step(GRPOAlgorithm(), UpdateSchedule(1, 1, recompute_prox=True)),
        "4 mini-batches": step(GRPOAlgorithm(), UpdateSchedule(4, 1, recompute_prox=True)),
        "kl (k3, loss)": step(GRPOAlgorithm(kl_coef=0.01)),
        "entropy": step(GRPOAlgorithm(entropy_coef=0.001)),
        "lora r=8": step(GRPOAlgorithm(), lora=LoraSpec(8, 16.0)),
        "ppo + critic": ppo,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/algorithm_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = TASKS["reverse_digits"]
    tok = build_char_tokenizer(task.alphabet)
    with tempfile.TemporaryDirectory() as model_dir:
        build_tiny_llama(task.model, tok, seed=0).save_pretrained(model_dir)
        samples = _batch(len(tok))
        variants = _variants(model_dir, samples)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, run in variants.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["default"])
    rows = [
        {"variant": name, "step_s": round(statistics.median(t), 4), "vs_default": round(statistics.median(t) / base, 2)}
        for name, t in times.items()
    ]
    tokens = sum(s.num_tokens for s in samples)
    print(f"{len(samples)} samples, {tokens} tokens per step; median of {args.rounds} interleaved rounds")
    print("| variant | step s | vs default |\n|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['step_s']:.3f} | {row['vs_default']:.2f}× |")
    write_results(args.out, args, rows, samples=len(samples), tokens=tokens)


if __name__ == "__main__":
    main()


def reference_logprobs(engine, samples, temperature):
    """``samples`` with the frozen reference's log-probs filled in."""
    ref = engine.logprobs(samples, temperature)
    return [dataclasses.replace(s, ref_logprobs=tuple(r)) for s, r in zip(samples, ref, strict=True)]
