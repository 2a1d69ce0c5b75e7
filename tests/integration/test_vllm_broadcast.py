"""Weights into vLLM's workers over the broadcast group (``fleet.weight_transfer: broadcast``):
this process is trainer rank 0 (``BroadcastWeightSync.publisher()``, gloo), the engine's worker
process joins as rank 1 and loads every version bucket by bucket as it arrives (64 KiB buckets:
a layer's tensors span several). After each update the engine's greedy tokens and log-probs are
the HF model's with the published weights, its checksum is the trainer's, and no file appeared
under ``/dev/shm`` or the temp folder. Run by ``make vllm-test``; skipped without vLLM.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sluice.api import Completion
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.hf_train import HFTrainEngine
from sluice.trainer.rendezvous import free_tcp_address
from sluice.weights import BroadcastWeightSync
from tiny import save_tiny_task_model

pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make vllm-test` runs these in .venv-vllm")

import vllm_support
from sluice.engines.vllm_engine import VLLMEngine
from vllm_support import files, generate_all, ids, recomputed, request

loop, model_dir, temp_root = vllm_support.loop, vllm_support.model_dir, vllm_support.temp_root  # module fixtures

BUCKET = 64 << 10


@pytest.fixture(scope="module")
def group(model_dir: Path, loop: asyncio.AbstractEventLoop, temp_root: Path) -> Iterator[tuple[VLLMEngine, object]]:
    """(an engine whose one worker is rank 1 of a gloo group, the group's publisher: rank 0 here)."""
    sync = BroadcastWeightSync(free_tcp_address(), receivers=1, backend="gloo", timeout_s=120, bucket_bytes=BUCKET)
    engine = VLLMEngine(
        model_dir, max_batch=16, kv_cache_mb=16, max_model_len=256, weight_group=sync.engines().worker_group(1)
    )
    loop.run_until_complete(engine.generate(request("warm", ids(model_dir, "1|"), 4, temperature=1.0)))
    yield engine, sync.publisher()
    engine.close()


def _trained(folder: Path) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """A version as the trainer publishes it (tied lm_head aliased) and the HF model holding it."""
    model = load_causal_lm(folder)
    return HFTrainEngine(model, lr=1e-3).export_weights(), model


def _greedy_matches(engine: VLLMEngine, model: torch.nn.Module, model_dir: Path, loop, version: int) -> None:
    greedy = [request(f"g{version}-{i}", ids(model_dir, p), 12, temperature=0.0) for i, p in enumerate(("907|", "4|"))]
    got = generate_all(loop, engine, greedy)
    hf = HFInferenceEngine(copy.deepcopy(model))
    futures = [hf.submit(r) for r in greedy]
    while hf.has_work():
        hf.step()
    for mine, ref in zip(got, (f.result() for f in futures), strict=True):
        assert mine.token_ids == ref.token_ids and set(mine.versions) == {version}
        assert mine.logprobs == pytest.approx(ref.logprobs, abs=2e-4)


def test_versions_reach_the_workers_bucket_by_bucket_in_interrupt_and_defer(
    group, model_dir: Path, loop, temp_root: Path, tmp_path: Path
) -> None:
    engine, publisher = group
    v1, m1 = _trained(save_tiny_task_model(tmp_path / "v1", head_dim=64, seed=1))
    v2, _ = _trained(save_tiny_task_model(tmp_path / "v2", head_dim=64, seed=2))
    v3, m3 = _trained(save_tiny_task_model(tmp_path / "v3", head_dim=64, seed=3))
    assert sum(t.numel() * t.element_size() for t in v1.values()) > 8 * BUCKET  # many buckets a version
    old = load_causal_lm(model_dir)
    before = files(temp_root)

    async def interrupted() -> list[Completion]:  # v1 arrives while requests decode
        tasks = [asyncio.ensure_future(engine.generate(request(f"i{i}", ids(model_dir, p), 120, seed=i)))
                 for i, p in enumerate(("12345|", "907|"))]  # fmt: skip
        while engine.stats()["generated_tokens"] < start + 30:
            await asyncio.sleep(0.002)
        publisher.publish(v1, 1)
        engine.update_weights({}, 1, "interrupt")
        return await asyncio.gather(*tasks)

    start = engine.stats()["generated_tokens"]
    got = loop.run_until_complete(interrupted())
    assert engine.version == 1 and engine.stats()["reprefill_tokens"] > 0
    assert engine.weights_checksum() == HFInferenceEngine(m1).weights_checksum()
    old_lp, new_lp = recomputed(old, got, 1.0), recomputed(m1, got, 1.0)
    for c, lp_old, lp_new in zip(got, old_lp, new_lp, strict=True):  # each token under its version's weights
        want = [o if v == 0 else n for v, o, n in zip(c.versions, lp_old, lp_new, strict=True)]
        assert c.logprobs == pytest.approx(want, abs=2e-4)
    assert any(len(set(c.versions)) == 2 for c in got)
    _greedy_matches(engine, m1, model_dir, loop, 1)

    async def deferred() -> Completion:  # v2 and v3 both published before the drain ends: v3 loads
        running = asyncio.ensure_future(engine.generate(request("d", ids(model_dir, "8|"), 100, seed=3)))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.002)
        publisher.publish(v2, 2)
        engine.update_weights({}, 2, "defer")
        publisher.publish(v3, 3)
        engine.update_weights({}, 3, "defer")
        done = await running
        while engine.version < 3:  # the load follows the drain
            await asyncio.sleep(0.01)
        return done

    ran = loop.run_until_complete(deferred())
    assert set(ran.versions) == {1} and len(ran.token_ids) == 100  # finished on the old weights
    assert engine.version == 3 and engine.stats()["weight_updates_superseded"] == 1
    assert engine.weights_checksum() == HFInferenceEngine(m3).weights_checksum()
    _greedy_matches(engine, m3, model_dir, loop, 3)
    assert files(temp_root) - before == set()  # no version touched a file
