"""Multi-turn prefix reuse in the built-in engine: CPU of the same episodes with and without it.

Runs the calculator task's base model (built and cached on first use) on multi-turn, GRPO-shaped
episodes: groups of ``--group`` episodes share a first prompt; each episode takes 1-3 turns of
up to 12 tokens, and between turns waits μ ± μ seconds (clipped at 0, no CPU) and appends an
observation of 3-7 tokens to its context, as ``sluice bench e2e --workload agentic-wait`` does.
``--concurrency`` episodes run at once. The engine runs with ``session_cache_mib`` 0 (every turn
prefills its whole context) and on (a turn extending its episode's previous one computes only its
new tokens). Rows report the process CPU seconds, prefill tokens and forwards, and the session
hits, and whether every turn sampled the same tokens (same seeds; the two paths round floats
differently, so a rare near-tie may flip a token). Prints a table and writes JSON.

    flock /tmp/bench.lock env PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/session_cache.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import torch
from harness.report import write_results

from sluice.api.types import GenerationRequest, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.tasks import TASKS
from sluice.tasks.base_model import ensure_base_model


async def _episode(engine: HFInferenceEngine, group: int, k: int, wait_s: float, vocab: int) -> list[tuple]:
    prompt_rng, rng = random.Random(group), random.Random(group * 1009 + k)
    context = tuple([1] + [prompt_rng.randrange(5, vocab) for _ in range(prompt_rng.randrange(15, 30))])
    turns = []
    for turn in range(rng.choice([1, 2, 2, 3])):
        params = SamplingParams(12, 1.0, 1.0, ())
        session = f"g{group}-e{k}"
        request = GenerationRequest(
            f"{session}-t{turn}", context, params, seed=group * 100 + k * 10 + turn, session=session
        )
        completion = await engine.generate(request)
        turns.append(completion.token_ids)
        await asyncio.sleep(max(0.0, rng.gauss(wait_s, wait_s)))
        context += completion.token_ids + tuple(rng.randrange(5, vocab) for _ in range(rng.randrange(3, 8)))
    return turns


def run(model_dir: Any, args: argparse.Namespace, mib: int) -> tuple[dict[str, Any], list]:
    model = load_causal_lm(model_dir)
    engine = HFInferenceEngine(model, max_batch=args.max_batch, session_cache_mib=mib, reprefill=False)
    vocab = model.config.vocab_size - 1

    async def main() -> list:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(group: int, k: int) -> list:
            async with gate:
                return await _episode(engine, group, k, args.wait_s, vocab)

        return await asyncio.gather(*(one(g, k) for g in range(args.groups) for k in range(args.group)))

    cpu, wall = time.process_time(), time.perf_counter()
    turns = asyncio.run(main())
    stats = engine.stats()
    row = {
        "session_cache_mib": mib,
        "cpu_s": round(time.process_time() - cpu, 2),
        "wall_s": round(time.perf_counter() - wall, 2),
        "turns": sum(map(len, turns)),
        **{
            k: int(stats.get(k, 0))
            for k in ("steps", "prefills", "prefill_tokens", "session_hits", "session_hit_tokens")
        },
    }
    return row, turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=160)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--wait-s", type=float, default=0.15)
    parser.add_argument("--out", default="benchmarks/results/session_cache.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = ensure_base_model(TASKS["calculator"], ".cache/sluice", seed=0, eval_count=500)
    off, reference = run(model_dir, args, 0)
    on, turns = run(model_dir, args, 256)
    pairs = [(a, b) for ea, eb in zip(reference, turns, strict=True) for a, b in zip(ea, eb, strict=True)]
    on["same_turns"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    off["same_turns"] = "-"
    rows = [off, on]
    head = (
        f"{'session cache':<14} {'cpu s':>6} {'wall s':>7} {'turns':>6} {'steps':>6} {'prefills':>8} "
        f"{'prefill tok':>11} {'hits':>6} {'same':>11}"
    )
    print(head)
    for r in rows:
        print(
            f"{'on' if r['session_cache_mib'] else 'off':<14} {r['cpu_s']:>6.2f} {r['wall_s']:>7.2f} {r['turns']:>6} "
            f"{r['steps']:>6} {r['prefills']:>8} {r['prefill_tokens']:>11} {r['session_hits']:>6} {r['same_turns']:>11}"
        )
    print(f"CPU on / off: {on['cpu_s'] / off['cpu_s']:.2f}")
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
