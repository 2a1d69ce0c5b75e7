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

import torch
from harness.engine_runs import long_tail_requests, run_builtin, run_vllm, throughput_row
from harness.report import write_results

from sluice.engines.hf_model import load_tokenizer
from sluice.tasks import TASKS
from sluice.tasks.base_model import ensure_base_model


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
    requests = long_tail_requests(tokenizer, args.prompts, args.group, task.max_new_tokens)
    seconds, reference = run_builtin(model_dir, requests, args.max_batch, wave=args.max_batch)
    rows = [throughput_row("static", seconds, reference, reference)]
    rows.append(throughput_row("continuous", *run_builtin(model_dir, requests, args.max_batch), reference))
    if args.vllm:
        rows.append(throughput_row("vllm", *run_vllm(model_dir, requests, args.max_batch, args.kv_cache_mb)))
    base = rows[0]["tokens_per_s"]
    print(f"{'mode':<11} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'speedup':>7}  p50/max  same")
    for r in rows:
        same = "-" if r["same_tokens"] is None else r["same_tokens"]
        print(
            f"{r['mode']:<11} {r['requests']:>8} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.0f} "
            f"{r['tokens_per_s'] / base:>6.2f}x  {r['len_p50']:>3}/{r['len_max']:<7}  {same}"
        )
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
