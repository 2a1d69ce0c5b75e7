"""HFInferenceEngine weight-update modes: interrupt re-prefills (or, without ``reprefill``, decodes on
over the stale cache), defer drains then swaps."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from sluice.api.types import Completion, GenerationRequest, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.sampling import sample_tokens, seed_key, uniforms
from tiny import tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def old() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="module")
def new() -> LlamaForCausalLM:
    return tiny_llama(1)


def _weights(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _checksum(weights: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().sum() for t in weights.values()))


def _req(rid: str, prompt: list[int], n: int, seed: int, temperature: float = 1.0, top_p: float = 1.0):
    return GenerationRequest(rid, tuple(prompt), SamplingParams(n, temperature, top_p), seed=seed)


def _drain(engine: HFInferenceEngine) -> None:
    while engine.has_work():
        engine.step()


def _alone(model: LlamaForCausalLM, request: GenerationRequest) -> Completion:
    engine = HFInferenceEngine(model, max_batch=1)
    future = engine.submit(request)
    _drain(engine)
    return future.result()


def _forced_logits(model: LlamaForCausalLM, c: Completion) -> torch.Tensor:
    """Logits predicting each response token, from one forward over prompt + response: [response, V]."""
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1]


def _assert_logprobs(model: LlamaForCausalLM, c: Completion, r: GenerationRequest, start: int = 0) -> None:
    logp = torch.log_softmax(_forced_logits(model, c) / r.params.temperature, -1)
    expected = logp.gather(1, torch.tensor(c.token_ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(c.logprobs)[start:], expected[start:], atol=1e-4, rtol=0)


def test_interrupt_reprefills_and_continues_under_new_weights(old, new) -> None:
    requests = [
        _req("a", [1, 2, 3], 12, seed=1),
        _req("b", [4, 5, 6, 7, 8], 12, seed=2, top_p=0.9),
        _req("c", [1, 2, 3], 12, seed=3, temperature=0.7),  # shares a's prompt
        _req("late", [9, 10], 12, seed=4),  # admitted one step later: a younger row
        _req("queued", [11, 12, 13], 6, seed=5),  # waits for a free slot: all new-version tokens
    ]
    engine = HFInferenceEngine(copy.deepcopy(old), max_batch=4, version=0)
    futures = [engine.submit(r) for r in requests[:3]]
    engine.step()  # prefill + 1 decode: 2 tokens each
    futures += [engine.submit(r) for r in requests[3:]]
    engine.step()
    engine.step()  # a, b, c: 4 tokens; late: 3 tokens
    engine.update_weights(_weights(new), version=1, mode="interrupt")
    assert engine.version == 1 and engine.stats()["reprefill_tokens"] > 0
    assert engine.weights_checksum() == pytest.approx(_checksum(_weights(new)), rel=1e-12)
    _drain(engine)
    done = [f.result() for f in futures]

    for c, r, before in zip(done, requests, (4, 4, 4, 3, 0), strict=True):
        assert c.versions == (0,) * before + (1,) * (r.params.max_new_tokens - before)
        reference = _alone(old, r)  # what the old weights alone produce
        assert c.token_ids[:before] == reference.token_ids[:before]
        assert c.logprobs[:before] == pytest.approx(reference.logprobs[:before], abs=1e-5)
        _assert_logprobs(new, c, r, start=before)  # the KV cache was rebuilt under the new weights
        logits = _forced_logits(new, c)
        index = torch.arange(before, len(c.token_ids))
        key = torch.full_like(index, seed_key(r.seed))
        temp = torch.full((len(index),), r.params.temperature)
        top_p = torch.full((len(index),), r.params.top_p, dtype=torch.float64)
        resampled, _ = sample_tokens(logits[before:], temp, top_p, uniforms(key, index))
        assert tuple(resampled.tolist()) == c.token_ids[before:]  # the seed counter continued
    assert done[-1].token_ids == _alone(new, requests[-1]).token_ids


def _stale_cache_logprobs(old, new, c: Completion, r: GenerationRequest, before: int) -> list[float]:
    """Log-probs of tokens ``before:`` decoded by ``new`` over the cache ``old`` computed for the prompt
    and the first ``before - 1`` tokens (the last emitted token is fed after the load)."""
    prompt, tokens = list(c.prompt_ids), list(c.token_ids)
    out = []
    with torch.no_grad():
        cache = old(input_ids=torch.tensor([prompt + tokens[: before - 1]]), use_cache=True).past_key_values
        for j in range(before, len(tokens)):
            step = new(
                input_ids=torch.tensor([[tokens[j - 1]]]),
                position_ids=torch.tensor([[len(prompt) + j - 1]]),
                past_key_values=cache,
                use_cache=True,
            )
            cache = step.past_key_values
            out.append(float(torch.log_softmax(step.logits[0, -1] / r.params.temperature, -1)[tokens[j]]))
    return out


def test_interrupt_without_reprefill_decodes_on_over_the_stale_cache(old, new) -> None:
    requests = [
        _req("a", [1, 2, 3], 10, seed=1),
        _req("b", [4, 5, 6, 7, 8], 10, seed=2, top_p=0.9),
        _req("late", [9, 10], 10, seed=4, temperature=0.7),  # admitted one step later
        _req("queued", [11, 12, 13], 6, seed=5),  # waits for a free slot: all new-version tokens
    ]
    engine = HFInferenceEngine(copy.deepcopy(old), max_batch=3, version=0, reprefill=False)
    futures = [engine.submit(r) for r in requests[:2]]
    engine.step()
    futures += [engine.submit(r) for r in requests[2:]]
    engine.step()
    engine.step()  # a, b: 4 tokens; late: 3 tokens
    engine.update_weights(_weights(new), version=1, mode="interrupt")
    stats = engine.stats()
    assert engine.version == 1 and stats["reprefill_tokens"] == 0 and stats["stale_cache_rows"] == 3
    _drain(engine)
    done = [f.result() for f in futures]

    for c, r, before in zip(done[:3], requests[:3], (4, 4, 3), strict=True):
        assert c.versions == (0,) * before + (1,) * (r.params.max_new_tokens - before)
        reference = _alone(old, r)
        assert c.token_ids[:before] == reference.token_ids[:before]
        assert c.logprobs[:before] == pytest.approx(reference.logprobs[:before], abs=1e-5)
        stale = _stale_cache_logprobs(old, new, c, r, before)
        assert c.logprobs[before:] == pytest.approx(stale, abs=1e-4)  # exactly what sampled them
        rebuilt = torch.log_softmax(_forced_logits(new, c) / r.params.temperature, -1)
        rebuilt = rebuilt.gather(1, torch.tensor(c.token_ids).unsqueeze(1)).squeeze(1)[before:]
        assert not torch.allclose(torch.tensor(stale), rebuilt, atol=1e-3)  # the cache was not rebuilt
    assert done[-1].token_ids == _alone(new, requests[-1]).token_ids


@pytest.mark.parametrize("mode", ["defer", "staggered"])
def test_defer_drains_on_old_weights_then_swaps(old, new, mode) -> None:
    running = [_req("long", [1, 2, 3], 10, seed=1), _req("short", [4, 5], 5, seed=2, top_p=0.9)]
    queued = [_req("q1", [6, 7, 8], 6, seed=3), _req("q2", [1, 2, 3], 6, seed=4)]
    engine = HFInferenceEngine(copy.deepcopy(old), max_batch=2, version=0)
    futures = [engine.submit(r) for r in running + queued[:1]]
    engine.step()
    source = _weights(new)
    engine.update_weights(source, version=1, mode=mode)
    expected = _checksum(source)
    for t in source.values():
        t.add_(1.0)  # the engine staged a copy, not a reference
    futures.append(engine.submit(queued[1]))
    stats = engine.stats()
    assert stats["version"] == 0 and stats["pending_version"] == 1 and stats["weight_updates"] == 0
    while engine.stats()["pending_version"] == 1:
        assert engine.stats()["waiting"] == 2  # a free slot (after "short") admits nothing
        engine.step()
    stats = engine.stats()
    assert stats["version"] == 1 and stats["pending_version"] == -1 and stats["weight_updates"] == 1
    assert stats["weight_drain_s"] > 0 and stats["version_activated_at"] > 0
    assert engine.weights_checksum() == pytest.approx(expected, rel=1e-12)
    _drain(engine)
    done = [f.result() for f in futures]
    for c, r in zip(done[:2], running, strict=True):  # finished on the old weights
        assert c.versions == (0,) * r.params.max_new_tokens
        assert c.token_ids == _alone(old, r).token_ids
        _assert_logprobs(old, c, r)
    for c, r in zip(done[2:], queued, strict=True):  # queued ones ran on the new version
        assert c.versions == (1,) * r.params.max_new_tokens
        assert c.token_ids == _alone(new, r).token_ids


def test_newer_staged_update_replaces_older_and_idle_swaps_at_once(old, new) -> None:
    engine = HFInferenceEngine(copy.deepcopy(old), version=0)
    future = engine.submit(_req("r", [1, 2], 6, seed=0))
    engine.step()
    engine.update_weights(_weights(tiny_llama(2)), version=1, mode="defer")
    engine.update_weights(_weights(new), version=2, mode="defer")
    assert engine.stats()["pending_version"] == 2 and engine.stats()["weight_updates_superseded"] == 1
    _drain(engine)
    assert future.result().versions == (0,) * 6
    assert engine.version == 2 and engine.stats()["weight_updates"] == 1
    assert engine.weights_checksum() == pytest.approx(_checksum(_weights(new)), rel=1e-12)
    engine.update_weights(_weights(old), version=3, mode="defer")  # nothing running: swaps now
    assert engine.version == 3 and engine.stats()["pending_version"] == -1
    engine.submit(_req("s", [1, 2], 6, seed=0))
    engine.step()
    engine.update_weights(_weights(new), version=4, mode="defer")
    engine.update_weights(_weights(old), version=5, mode="interrupt")  # replaces the staged v4
    stats = engine.stats()
    assert engine.version == 5 and stats["pending_version"] == -1 and stats["weight_updates_superseded"] == 2
    assert engine.weights_checksum() == pytest.approx(_checksum(_weights(old)), rel=1e-12)


def test_defer_through_the_async_driver(old, new) -> None:
    engine = HFInferenceEngine(copy.deepcopy(old), max_batch=1, version=0)

    async def main() -> list[Completion]:
        first = asyncio.ensure_future(engine.generate(_req("a", [1, 2], 8, seed=0)))
        second = asyncio.ensure_future(engine.generate(_req("b", [3, 4], 4, seed=1)))
        for _ in range(3):
            await asyncio.sleep(0)
        engine.update_weights(_weights(new), version=1, mode="defer")
        return list(await asyncio.gather(first, second))

    a, b = asyncio.run(main())
    assert a.versions == (0,) * 8 and b.versions == (1,) * 4 and not engine.has_work()
