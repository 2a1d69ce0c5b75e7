"""HFInferenceEngine: continuous batching is exact, log-probs match a forward pass, control works."""

from __future__ import annotations

import asyncio
import copy
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from sluice.api.protocols import VersionedEngine
from sluice.api.types import Completion, GenerationRequest, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine, sample_tokens
from tiny import tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(0)


def _req(rid: str, prompt: list[int], n: int = 8, seed: int = 0, **params: object) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), SamplingParams(max_new_tokens=n, **params), seed=seed)  # type: ignore[arg-type]


def _run(engine: HFInferenceEngine, requests: list[GenerationRequest]) -> list[Completion]:
    futures = [engine.submit(r) for r in requests]
    while engine.has_work():
        engine.step()
    return [f.result() for f in futures]


def _alone(model: LlamaForCausalLM, request: GenerationRequest) -> Completion:
    return _run(HFInferenceEngine(model, max_batch=1), [request])[0]


def _mixed_requests() -> list[GenerationRequest]:
    prompts = [
        [1, 2, 3],
        [4, 5, 6, 7, 8, 9],
        [10],
        [11, 12, 13, 14],
        [1, 2, 3],
        [20, 21],
        [5] * 9,
        [30, 31, 2],
    ]
    temperatures, top_ps = (0.0, 1.0, 0.7), (1.0, 0.9)
    return [
        _req(f"r{i}", p, 4 + 3 * (i % 4), 100 + i, temperature=temperatures[i % 3], top_p=top_ps[i % 2],
             stop_token_ids=(7, 9) if i % 2 else ())
        for i, p in enumerate(prompts)
    ]  # fmt: skip


def test_engine_satisfies_protocol(model: LlamaForCausalLM) -> None:
    assert isinstance(HFInferenceEngine(model), VersionedEngine)


def test_continuous_batching_equals_one_at_a_time(model: LlamaForCausalLM) -> None:
    requests = _mixed_requests()
    engine = HFInferenceEngine(model, max_batch=3)

    async def main() -> list[Completion]:
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    batched = asyncio.run(main())
    singles = [_alone(model, r) for r in requests]
    for b, s in zip(batched, singles, strict=True):
        assert b.token_ids == s.token_ids
        assert b.finish_reason == s.finish_reason
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-5)
    assert {c.finish_reason for c in batched} == {"stop", "length"}
    assert all(len(c.token_ids) == r.params.max_new_tokens for c, r in zip(batched, requests, strict=True)
               if c.finish_reason == "length")  # fmt: skip
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["generated_tokens"] == sum(len(c.token_ids) for c in batched)


def test_drive_time_counts_the_other_work_of_the_engines_thread(model: LlamaForCausalLM) -> None:
    """``drive_s`` is the wall time of driven iterations, including other coroutines that run on
    the thread between steps (rewards, queue writes): the effective iteration time the planner's
    calibration reads. A busy neighbour coroutine adds its time; an idle engine adds none."""
    requests = _mixed_requests()

    async def run(busy_s: float) -> dict[str, float]:
        engine = HFInferenceEngine(model, max_batch=3)
        done = asyncio.Event()

        async def neighbour() -> None:  # blocks the thread for busy_s between the engine's steps
            while not done.is_set():
                t = asyncio.get_running_loop().time()
                while asyncio.get_running_loop().time() - t < busy_s:
                    pass
                await asyncio.sleep(0)

        task = asyncio.create_task(neighbour())
        await asyncio.gather(*(engine.generate(r) for r in requests))
        done.set()
        await task
        await asyncio.sleep(0.05)  # idle: no steps, no drive time
        return engine.stats()

    quiet, loaded = asyncio.run(run(0.0)), asyncio.run(run(0.01))
    assert quiet["steps"] == loaded["steps"] > 0
    assert 0 < quiet["drive_s"] < loaded["drive_s"]
    assert loaded["drive_s"] >= 0.01 * loaded["steps"] * 0.9


def _teacher_forced(model: LlamaForCausalLM, c: Completion, temperature: float) -> torch.Tensor:
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1)  # [response, V]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward(model: LlamaForCausalLM, temperature: float) -> None:
    requests = [
        _req(f"t{i}", [3 + i] * (2 + i), n=12, seed=i, temperature=temperature, top_p=0.8 if i else 1.0)
        for i in range(4)
    ]
    for c in _run(HFInferenceEngine(model, max_batch=2), requests):
        logp = _teacher_forced(model, c, temperature)
        expected = logp.gather(1, torch.tensor(c.token_ids).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_greedy_is_argmax_of_forward(model: LlamaForCausalLM) -> None:
    requests = [_req(f"g{i}", [1 + i, 2, 3 + i], n=10, seed=i, temperature=0.0) for i in range(3)]
    for c in _run(HFInferenceEngine(model), requests):
        logp = _teacher_forced(model, c, 1.0)
        assert c.token_ids == tuple(logp.argmax(-1).tolist())
        expected = logp.max(-1).values
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
    a, b = _run(
        HFInferenceEngine(model),
        [_req("x", [4, 5], seed=1, temperature=0.0), _req("y", [4, 5], seed=2, temperature=0.0)],
    )
    assert a.token_ids == b.token_ids


def test_abort_waiting_and_running(model: LlamaForCausalLM) -> None:
    engine = HFInferenceEngine(model, max_batch=1)
    running = engine.submit(_req("run", [1, 2], n=20))
    waiting = engine.submit(_req("wait", [3, 4], n=20))
    engine.step()
    engine.step()
    engine.abort("wait")
    assert waiting.done()
    assert waiting.result().finish_reason == "abort" and waiting.result().token_ids == ()
    engine.abort("run")
    assert not running.done()
    engine.step()
    done = running.result()
    assert done.finish_reason == "abort" and len(done.token_ids) == 3 == len(done.logprobs) == len(done.versions)
    assert not engine.has_work()
    engine.abort("run")  # unknown or finished ids are ignored
    again = _run(engine, [_req("run", [1, 2], n=20)])[0]
    assert again.token_ids[:3] == done.token_ids


def test_pause_resume_and_cancel(model: LlamaForCausalLM) -> None:
    engine = HFInferenceEngine(model, max_batch=4)
    future = engine.submit(_req("p", [1, 2], n=5))
    engine.step()
    engine.pause()
    for _ in range(3):
        engine.step()
    assert engine.stats()["generated_tokens"] == 2 and not future.done()
    engine.resume()
    while engine.has_work():
        engine.step()
    assert len(future.result().token_ids) == 5

    async def main() -> Completion:
        task = asyncio.ensure_future(engine.generate(_req("c", [1, 2], n=50)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine.generate(_req("d", [1, 2], n=3))

    assert len(asyncio.run(main()).token_ids) == 3
    assert not engine.has_work()


def test_seed_determines_tokens(model: LlamaForCausalLM) -> None:
    reqs = [
        _req("a", [1, 2, 3], n=16, seed=7),
        _req("b", [1, 2, 3], n=16, seed=7),
        _req("c", [1, 2, 3], n=16, seed=8),
    ]
    a, b, c = _run(HFInferenceEngine(model), reqs)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids
    assert _alone(model, reqs[2]).token_ids == c.token_ids


def test_update_weights_changes_outputs_and_versions(model: LlamaForCausalLM) -> None:
    engine = HFInferenceEngine(copy.deepcopy(model), version=3)
    request = _req("w", [1, 2, 3], n=8, temperature=0.0)
    before = _run(engine, [request])[0]
    assert before.versions == (3,) * 8
    torch.manual_seed(1)
    new = {n: p + 0.5 * torch.randn_like(p) for n, p in model.named_parameters()}
    future = engine.submit(request)
    engine.step()  # prefill + one decode: 2 tokens on v3
    engine.update_weights(new, version=4, mode="interrupt")
    while engine.has_work():
        engine.step()
    assert future.result().versions == (3, 3) + (4,) * 6
    after = _run(engine, [request])[0]
    assert after.versions == (4,) * 8 and after.token_ids != before.token_ids
    assert engine.stats()["version"] == 4.0
    with pytest.raises(ValueError, match="unknown"):
        engine.update_weights({**new, "model.nonexistent.weight": torch.zeros(1)}, version=5)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights({"model.norm.weight": new["model.norm.weight"]}, version=5)
    with pytest.raises(ValueError, match="mode"):
        engine.update_weights(new, version=5, mode="sideways")  # type: ignore[arg-type]
    assert engine.version == 4


def test_prefix_sharing_equals_distinct_submission(model: LlamaForCausalLM) -> None:
    prompt = [2, 4, 6, 8, 10]
    group = [_req(f"s{i}", prompt, n=10, seed=i, top_p=0.95) for i in range(6)]
    engine = HFInferenceEngine(model)
    shared = _run(engine, [*group, _req("other", [1, 3, 5, 7, 9], n=4)])[:6]
    assert engine.stats()["prefill_tokens"] == 2 * len(prompt)
    for s, r in zip(shared, group, strict=True):
        assert s.token_ids == _alone(model, r).token_ids
    assert len({s.token_ids for s in shared}) > 1


def test_sample_tokens_inverse_cdf_and_top_p() -> None:
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log().expand(4, 3)
    u = torch.tensor([0.05, 0.65, 0.95, 0.95], dtype=torch.float64)
    temp, full = torch.ones(4), torch.ones(4, dtype=torch.float64)
    tokens, logp = sample_tokens(logits, temp, full, u)
    assert tokens.tolist() == [0, 1, 2, 2]
    torch.testing.assert_close(logp, torch.tensor([0.6, 0.3, 0.1, 0.1]).log())
    nucleus = torch.tensor([0.5, 0.5, 0.5, 0.7], dtype=torch.float64)  # keeps {0} and {0, 1}
    assert sample_tokens(logits, temp, nucleus, u)[0].tolist() == [0, 0, 0, 1]
    greedy = sample_tokens(logits, torch.zeros(4), full, u)
    assert greedy[0].tolist() == [0, 0, 0, 0]


def test_from_pretrained_loads_a_saved_folder(model: LlamaForCausalLM, tmp_path: Path) -> None:
    model.save_pretrained(tmp_path)
    request = _req("f", [1, 2, 3], n=6, temperature=0.0)
    loaded = HFInferenceEngine.from_pretrained(tmp_path, max_batch=2, version=7)
    completion = _run(loaded, [request])[0]
    assert completion.token_ids == _alone(model, request).token_ids
    assert completion.versions == (7,) * 6 and not loaded.model.training


def test_prefills_count_one_forward_per_admission_whatever_the_prompt_lengths(model: LlamaForCausalLM) -> None:
    """``prefills`` counts prefill forwards: requests admitted together share one left-padded
    forward whatever their prompt lengths (``kv_batch.prefill_plan``); requests trickling in one
    per step while rows run (as agent calls do) each cost one (``benchmarks/agent_vs_env.py``
    reports it). The model runs exactly the forwards counted, and every request's tokens and
    log-probs equal its run alone."""
    forwards = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: forwards.append(1)
    )  # one per forward
    try:
        together = HFInferenceEngine(model, max_batch=16)
        requests = [_req(f"a{i}", [1 + i, 2, 3, 4][: 1 + i % 4], seed=i, temperature=1.0) for i in range(8)]
        completions = _run(together, requests)
    finally:
        hook.remove()
    assert together.stats()["prefills"] == 1  # one admission, four prompt lengths
    assert len(forwards) == 1 + together.stats()["steps"]  # the prefill, then one decode forward per step
    for request, completion in zip(requests, completions, strict=True):
        alone = _alone(model, request)
        assert completion.token_ids == alone.token_ids, request.request_id
        assert completion.logprobs == pytest.approx(alone.logprobs, abs=1e-4), request.request_id
    trickled = HFInferenceEngine(model, max_batch=16)
    futures = [trickled.submit(_req("long", [1, 2, 3], n=20, seed=1))]
    for i in range(5):
        trickled.step()
        futures.append(trickled.submit(_req(f"t{i}", [4 + i, 5], n=3, seed=10 + i)))
    while trickled.has_work():
        trickled.step()
    assert all(f.done() for f in futures) and trickled.stats()["prefills"] == 6


@pytest.mark.parametrize("seed", [4, 7])  # schedules that re-expose columns of departed rows
def test_rows_joining_wider_than_the_cache_after_others_left_read_no_stale_columns(
    model: LlamaForCausalLM, seed: int
) -> None:
    """Rows come and go at random with prompts of mixed lengths (an agent's growing histories):
    when a joiner wider than the cache re-exposes columns left of it, the running rows' slots there
    hold keys, values and mask of rows that left, which must not be read. Every request's tokens
    and log-probs equal its run alone."""
    rng = random.Random(seed)
    engine = HFInferenceEngine(model, max_batch=6)
    requests, futures = [], []
    for _ in range(60):
        if rng.random() < 0.5:
            prompt = [rng.randrange(1, 30) for _ in range(rng.choice([2, 3, 5, 9, 14, 20, 27]))]
            n = len(requests)
            requests.append(_req(f"r{n}", prompt, rng.choice([2, 4, 7, 12]), n, temperature=1.0))
            futures.append(engine.submit(requests[-1]))
        if engine.has_work():
            engine.step()
    while engine.has_work():
        engine.step()
    for request, future in zip(requests, futures, strict=True):
        alone, batched = _alone(model, request), future.result()
        assert batched.token_ids == alone.token_ids, request.request_id
        assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4), request.request_id


def test_a_left_padded_prefill_leaves_zero_masked_pad_columns(model: LlamaForCausalLM) -> None:
    """Prompts of different lengths share one forward: the shorter one's pad columns are masked
    and hold zeros in the cache (the slab's invariant for columns nobody reads), and each row's
    logits equal its own unpadded prefill's."""
    from sluice.engines.kv_batch import prefill

    with torch.inference_mode():
        cache, mask, logits, computed = prefill(model, [(5, 6, 7, 8), (9, 10), (5, 6, 7, 8)])
        alone = [prefill(model, [p])[2] for p in [(5, 6, 7, 8), (9, 10)]]
    assert mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]] and computed == 6
    for layer in cache.layers:
        assert not layer.keys[1, :, :2].any() and not layer.values[1, :, :2].any()
        assert layer.keys[1, :, 2:].abs().sum() > 0
    assert torch.allclose(logits[0], alone[0][0], atol=1e-5) and torch.allclose(logits[1], alone[1][0], atol=1e-5)
    assert torch.equal(logits[0], logits[2])


@pytest.mark.parametrize("wider", [False, True])  # the next wave fits the spare slab / needs a new one
def test_a_wave_reuses_the_slab_of_the_last_and_computes_the_same_bits(model: LlamaForCausalLM, wider: bool) -> None:
    """Rows that stop running leave their KV slab to the next admission (no fresh zeroed memory per
    sync wave); its stale rows and columns are never read, so the next wave's tokens and log-probs
    are bit for bit a fresh engine's."""
    first = [_req(f"a{i}", [1 + i, 2, 3, 4, 5][: 2 + i % 4], n=3 + i, seed=i, temperature=1.0) for i in range(6)]
    width = 30 if wider else 4
    second = [_req(f"b{i}", [7, 1 + i, 2, 9, 4][: 1 + i % 4] * (width // 4), n=9, seed=20 + i) for i in range(5)]
    engine = HFInferenceEngine(model, max_batch=8)
    _run(engine, first)
    spare = engine._spare
    assert spare is not None
    seen = []
    step = engine.step

    def watch() -> None:
        step()
        if engine._rows is not None:
            seen.append(engine._rows.slab.bufs[0].data_ptr())

    engine.step = watch  # type: ignore[method-assign]
    again = _run(engine, second)
    assert (seen[0] == spare.bufs[0].data_ptr()) is not wider
    fresh = _run(HFInferenceEngine(model, max_batch=8), second)
    for a, b in zip(again, fresh, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
