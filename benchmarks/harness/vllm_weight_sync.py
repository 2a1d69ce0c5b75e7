"""How long a vLLM engine stands closed per weight update: folder reload vs tensors in memory vs
the broadcast group into vLLM's worker.

``benchmarks/weight_sync.py --vllm`` calls ``measure_vllm`` once per model and transfer
(``vllm.weight_transfer``'s ``folder`` and ``memory``, and ``broadcast``: this process publishes
as trainer rank 0 of a gloo group, ``fleet.weight_transfer: broadcast``, and the engine's worker
receives and loads bucket by bucket), each with its own ``VLLMEngine`` (the stager is fixed when
the engine starts) in this process and on one event loop. Per version: ``update_weights`` in
``defer`` mode on an idle engine, then wait until ``stats()["version"]`` names it, then
``GAP_S`` of quiet (a training step between two versions: the engine's processes settle). Columns,
medians over the versions (the first update is a warm-up and not counted):

- ``stage s``: the ``update_weights`` call itself (folder: write ``model.safetensors`` to tmpfs;
  memory: snapshot the tensors; broadcast: the trainer's ``publish``, its one packing copy),
  which blocks whoever hands the weights over;
- ``load s``: vLLM's ``reload_weights`` RPC plus the prefix-cache reset (``weight_load_s``);
- ``exposed s``: from the call to the new version being active: the time per training step
  that the engine admits no request because of the weight sync;
- ``files``: files that appeared under the weights folder per update (0 in memory);
- ``greedy ok``: greedy tokens after the last update equal the HF model's with those weights.

Needs vLLM (``.venv-vllm``). Not here: the Ray rows, printing (``weight_sync.py``).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from harness.engine_runs import close_vllm
from sluice.api import GenerationRequest, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.tasks import TASKS
from sluice.tasks.spec import TinyLlamaSpec
from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama

MODELS = {
    "tiny": TinyLlamaSpec(128, 2, 2, 1, 256, 256),
    "small": TinyLlamaSpec(768, 6, 12, 4, 2048, 256),
    "medium": TinyLlamaSpec(1024, 12, 16, 8, 4096, 256),
}
"""Llama shapes with 64-wide heads (what vLLM's CPU attention takes): 0.3 M, 38 M, 190 M parameters."""

PROMPT = (1, 5, 6, 7, 8)
GAP_S = 1.0


def build_models(name: str, root: Path) -> tuple[Path, list[dict[str, torch.Tensor]], int]:
    """The model folder the engine starts from (seed 0), two weight sets (seeds 1 and 0) that
    versions alternate between, the last one being seed 1's, and the parameter count."""
    tok = build_char_tokenizer(TASKS["reverse_digits"].alphabet)
    folder = root / name
    build_tiny_llama(MODELS[name], tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    sets = [build_tiny_llama(MODELS[name], tok, seed=s).state_dict() for s in (1, 0)]
    params = sum(w.numel() for w in load_causal_lm(folder).parameters())
    return folder, sets, params


def _greedy(n: int) -> GenerationRequest:
    return GenerationRequest(f"greedy-{n}", PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0), seed=0)


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file())


async def _updates(
    engine: Any, update: Any, sets: list[dict[str, torch.Tensor]], versions: int, root: Path
) -> dict[str, list]:
    rows: dict[str, list] = {"stage_s": [], "load_s": [], "exposed_s": [], "files": []}
    for version in range(1, versions + 2):
        files, loaded = _files(root), engine.stats()["weight_load_s"]
        start = time.perf_counter()
        update(sets[(versions + 1 - version) % 2], version)
        staged = time.perf_counter()
        new_files = _files(root) - files
        while engine.stats()["version"] != version:
            await asyncio.sleep(0.0005)
        active = time.perf_counter()
        await asyncio.sleep(GAP_S)
        if version == 1:
            continue
        rows["stage_s"].append(staged - start)
        rows["load_s"].append(engine.stats()["weight_load_s"] - loaded)
        rows["exposed_s"].append(active - start)
        rows["files"].append(new_files)
    return rows


def measure_vllm(name: str, mode: str, versions: int, kv_cache_mb: int = 64) -> dict[str, Any]:
    """One row: ``name``'s model (``MODELS``) served by a ``VLLMEngine`` whose updates come by
    ``mode``: a ``weight_transfer`` (``folder``, ``memory``) or ``broadcast`` (the group)."""
    from sluice.engines.vllm_engine import VLLMEngine
    from sluice.trainer.rendezvous import free_tcp_address
    from sluice.weights import BroadcastWeightSync

    with (
        tempfile.TemporaryDirectory(prefix="vllm-sync-models-") as tmp,
        tempfile.TemporaryDirectory(
            prefix="vllm-sync-weights-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        ) as weights_root,
    ):
        folder, sets, params = build_models(name, Path(tmp))
        group = BroadcastWeightSync(free_tcp_address(), receivers=1, backend="gloo") if mode == "broadcast" else None
        engine = VLLMEngine(folder, max_batch=4, kv_cache_mb=kv_cache_mb, max_model_len=256, weights_dir=weights_root,
                            weight_transfer="memory" if group else mode,  # type: ignore[arg-type]
                            weight_group=group.engines().worker_group(1) if group else None)  # fmt: skip

        def update(weights: dict[str, torch.Tensor], version: int) -> None:
            if group is None:
                engine.update_weights(weights, version, "defer")
            else:  # the trainer's publish, then the engine loads the version from the group
                group.publisher().publish(weights, version)
                engine.update_weights({}, version, "defer")

        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(engine.generate(_greedy(0)))
            rows = loop.run_until_complete(_updates(engine, update, sets, versions, Path(weights_root)))
            got = loop.run_until_complete(engine.generate(_greedy(1)))
        finally:
            close_vllm(engine, loop)
        model = load_causal_lm(folder)
        model.load_state_dict(sets[0])  # the last version's weights (seed 1: not the start's)
        reference = HFInferenceEngine(model)
        future = reference.submit(_greedy(2))
        while reference.has_work():
            reference.step()
    return {
        "model": name, "mode": mode, "params_m": round(params / 1e6, 2), "mb": round(params * 4 / 2**20, 1),
        "greedy_ok": got.token_ids == future.result().token_ids,
        **{k: round(statistics.median(v), 4) for k, v in rows.items()},
    }  # fmt: skip
