"""Engine throughput on long-tailed rollouts: continuous vs static (wave) batching, and vLLM.

Runs the embedded default's base model (built and cached on first use) on GRPO-shaped
requests (prompts × group size, temperature 1) of the reverse-digits task, whose response
lengths are long-tailed. ``static`` admits a wave of ``max_batch`` requests and waits for the
whole wave before the next (the classic synchronous batch); ``continuous`` lets a finished
sequence's slot go to a waiting request at the next step. Both produce identical tokens (same
seeds), so the difference is pure scheduling. ``--vllm`` adds vLLM (``VLLMEngine``, same model
folder in float32, ``max_num_seqs = max_batch``) on the same requests; it samples with its own
generator, so its lengths follow the same distribution but are not the same draws. vLLM's engine
core binds its own process to one core. Prints a table and writes JSON.

    .venv/bin/python benchmarks/engine_throughput.py [--prompts 64] [--group 8] [--max-batch 128]
    .venv-vllm/bin/python benchmarks/engine_throughput.py --vllm      # after `make vllm-venv`
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import torch

from sluice.api import GenerationRequest, SamplingParams
from sluice.bench.report import write_results
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm, load_tokenizer
from sluice.rollout.single_turn import sample_seed
from sluice.tasks import TASKS
from sluice.tasks.base_model import ensure_base_model


def _requests(tokenizer, prompts: int, group: int, max_new: int) -> list[GenerationRequest]:
    task = TASKS["reverse_digits"]
    rng = random.Random(7)
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    out = []
    for g in range(prompts):
        ids = tuple(tokenizer(task.make_row(rng)["prompt"])["input_ids"])
        out += [GenerationRequest(f"{g}-{k}", ids, params, sample_seed(0, g, k)) for k in range(group)]
    return out


def _run(engine: HFInferenceEngine, requests: list[GenerationRequest], wave: int | None) -> tuple[float, list]:
    start = time.perf_counter()
    results = []
    chunks = [requests] if wave is None else [requests[i : i + wave] for i in range(0, len(requests), wave)]
    for chunk in chunks:
        futures = [engine.submit(r) for r in chunk]
        while engine.has_work():
            engine.step()
        results += [f.result() for f in futures]
    return time.perf_counter() - start, results


def _run_vllm(model_dir: Path, requests: list[GenerationRequest], max_batch: int, kv_cache_mb: int) -> tuple:
    """(seconds, completions) of all requests submitted at once to a warmed-up ``VLLMEngine``."""
    from sluice.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, max_batch=max_batch, kv_cache_mb=kv_cache_mb)

    async def generate(batch: list[GenerationRequest]) -> list:
        return await asyncio.gather(*(engine.generate(r) for r in batch))

    loop = asyncio.new_event_loop()
    try:
        warm = [GenerationRequest(f"warm-{r.request_id}", r.prompt_ids, r.params, r.seed) for r in requests[:8]]
        loop.run_until_complete(generate(warm))  # the first sampled batch with log-probs is slow once
        start = time.perf_counter()
        results = loop.run_until_complete(generate(requests))
        return time.perf_counter() - start, results
    finally:
        engine.close()
        pending = asyncio.all_tasks(loop)  # vLLM's output handler outlives the engine's shutdown
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


def _row(mode: str, seconds: float, results: list, reference: list | None) -> dict:
    tokens = [list(c.token_ids) for c in results]
    lengths = sorted(len(t) for t in tokens)
    return {
        "mode": mode, "requests": len(results), "tokens": sum(lengths), "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(lengths) / seconds, 1),
        "len_p50": lengths[len(lengths) // 2], "len_max": lengths[-1],
        "same_tokens_as_static": tokens == reference if reference is not None else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm", action="store_true", help="add vLLM (needs the vLLM venv)")
    parser.add_argument("--kv-cache-mb", type=int, default=256, help="vLLM KV cache")
    parser.add_argument("--out", default="benchmarks/results/engine_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = TASKS["reverse_digits"]
    model_dir = ensure_base_model(task, ".cache/sluice", seed=0, eval_count=500)
    tokenizer = load_tokenizer(model_dir)
    requests = _requests(tokenizer, args.prompts, args.group, task.max_new_tokens)
    rows = []
    reference = None
    for mode, wave in (("static", args.max_batch), ("continuous", None)):
        engine = HFInferenceEngine(load_causal_lm(model_dir), max_batch=args.max_batch)
        _run(engine, requests[: args.group], None)  # warm-up
        seconds, results = _run(engine, requests, wave)
        reference = reference or [list(c.token_ids) for c in results]
        rows.append(_row(mode, seconds, results, reference))
    if args.vllm:
        rows.append(_row("vllm", *_run_vllm(model_dir, requests, args.max_batch, args.kv_cache_mb), None))
    base = rows[0]["tokens_per_s"]
    print(f"{'mode':<11} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'speedup':>7}  p50/max  same")
    for r in rows:
        same = "-" if r["same_tokens_as_static"] is None else r["same_tokens_as_static"]
        print(
            f"{r['mode']:<11} {r['requests']:>8} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.0f} "
            f"{r['tokens_per_s'] / base:>6.2f}x  {r['len_p50']:>3}/{r['len_max']:<7}  {same}"
        )
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
