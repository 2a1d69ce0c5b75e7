"""Real engines on one long-tailed request mix: the runners behind ``benchmarks/rollout.py`` part (a)
and ``benchmarks/engine_throughput.py``.

- ``long_tail_requests``: GRPO-shaped requests (prompts × group size, temperature 1) of the
  embedded reverse-digits task, whose response lengths are long-tailed.
- ``run_builtin``: the built-in ``HFInferenceEngine``, continuous batching or static waves.
- ``run_hf_generate``: Hugging Face ``model.generate`` on static, left-padded batches (sampling at
  temperature 1, each row stops at EOS): the classic batch rollout, where a batch lasts as long
  as its longest row.
- ``run_vllm``: ``VLLMEngine`` in this process (needs vLLM installed: ``.venv-vllm``).

Each returns ``(seconds, token lists)`` after a warm-up; ``throughput_row`` turns that into a table
row. Not here: printing tables or choosing what to compare (the benchmark scripts do).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import torch

from sluice.api import GenerationRequest, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.rollout.single_turn import sample_seed
from sluice.tasks import TASKS

Tokens = list[list[int]]


def long_tail_requests(
    tokenizer: Any, prompts: int, group: int, max_new: int, seed: int = 7
) -> list[GenerationRequest]:
    """``prompts`` reverse-digits prompts × ``group`` samples each, temperature 1, stop at EOS."""
    task = TASKS["reverse_digits"]
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    out = []
    for g in range(prompts):
        ids = tuple(tokenizer(task.make_row(rng)["prompt"])["input_ids"])
        out += [GenerationRequest(f"{g}-{k}", ids, params, sample_seed(0, g, k)) for k in range(group)]
    return out


def drive(engine: HFInferenceEngine, requests: list[GenerationRequest], wave: int | None) -> tuple[float, Tokens]:
    """Run ``requests`` on ``engine`` by stepping it: all at once (``wave=None``: continuous
    batching refills a finished row's slot at once) or in waves of ``wave`` (static batches)."""
    start = time.perf_counter()
    tokens: Tokens = []
    chunks = [requests] if wave is None else [requests[i : i + wave] for i in range(0, len(requests), wave)]
    for chunk in chunks:
        futures = [engine.submit(r) for r in chunk]
        while engine.has_work():
            engine.step()
        tokens += [list(f.result().token_ids) for f in futures]
    return time.perf_counter() - start, tokens


def run_builtin(
    model_dir: Path, requests: list[GenerationRequest], max_batch: int, wave: int | None = None, **engine: Any
) -> tuple[float, Tokens]:
    """The built-in engine (``engine``: extra constructor options), warmed up on one group first."""
    built = HFInferenceEngine(load_causal_lm(model_dir), max_batch=max_batch, **engine)
    warm = [GenerationRequest(f"warm-{r.request_id}", r.prompt_ids, r.params, r.seed) for r in requests[:8]]
    drive(built, warm, None)
    return drive(built, requests, wave)


def run_hf_generate(
    model_dir: Path, requests: list[GenerationRequest], batch: int, pad_id: int
) -> tuple[float, Tokens]:
    """``model.generate`` on static batches of ``batch`` requests, in order, left-padded; a row's
    tokens end at its first stop token (the rest of the batch's columns are padding)."""
    model = load_causal_lm(model_dir).eval()
    params = requests[0].params
    stops = set(params.stop_token_ids)

    def generate(chunk: list[GenerationRequest]) -> Tokens:
        width = max(len(r.prompt_ids) for r in chunk)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in chunk])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in chunk])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=params.temperature, top_p=1.0,
                top_k=0, max_new_tokens=params.max_new_tokens, eos_token_id=list(stops), pad_token_id=pad_id,
            )  # fmt: skip
        rows = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            rows.append(row[:end])
        return rows

    generate(requests[:8])  # warm-up
    start = time.perf_counter()
    tokens: Tokens = []
    for i in range(0, len(requests), batch):
        tokens += generate(requests[i : i + batch])
    return time.perf_counter() - start, tokens


def run_vllm(
    model_dir: Path, requests: list[GenerationRequest], max_batch: int, kv_cache_mb: int
) -> tuple[float, Tokens]:
    """All requests submitted at once to a warmed-up ``VLLMEngine`` (float32, ``max_num_seqs = max_batch``)."""
    from sluice.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, max_batch=max_batch, kv_cache_mb=kv_cache_mb)

    async def generate(batch: list[GenerationRequest]) -> Tokens:
        return [list(c.token_ids) for c in await asyncio.gather(*(engine.generate(r) for r in batch))]

    loop = asyncio.new_event_loop()
    try:
        warm = [GenerationRequest(f"warm-{r.request_id}", r.prompt_ids, r.params, r.seed) for r in requests[:8]]
        loop.run_until_complete(generate(warm))  # the first sampled batch with log-probs is slow once
        start = time.perf_counter()
        tokens = loop.run_until_complete(generate(requests))
        return time.perf_counter() - start, tokens
    finally:
        close_vllm(engine, loop)


def close_vllm(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Close a vLLM engine and the event loop it ran on (its output handler outlives the engine's
    shutdown: cancel what is left, then close the loop)."""
    engine.close()
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def throughput_row(mode: str, seconds: float, tokens: Tokens, reference: Tokens | None = None) -> dict[str, Any]:
    """One table row: requests, generated tokens, seconds, tokens/s, length p50 / max, and whether
    the tokens equal ``reference`` (same seeds, same sampler)."""
    lengths = sorted(len(t) for t in tokens)
    return {
        "mode": mode, "requests": len(tokens), "tokens": sum(lengths), "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(lengths) / seconds, 1), "len_p50": lengths[len(lengths) // 2],
        "len_max": lengths[-1], "same_tokens": tokens == reference if reference is not None else None,
    }  # fmt: skip
