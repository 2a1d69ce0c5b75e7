"""Multi-turn prefix reuse in the built-in engine: a session's next turn computes only its new
tokens over the cache its previous turn left, with the tokens and log-probs a full prefill gives."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from sluice.api.types import Completion, GenerationRequest, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.kv_batch import prefill
from sluice.engines.session_cache import KeptTurn, SessionCache, continue_prefill
from tiny import tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(0)


def _turn(rid: str, prompt: tuple[int, ...], session: str | None, seed: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=5), seed=seed, session=session)


def _episodes(engine: HFInferenceEngine, episodes: int = 6, turns: int = 3, load_after: int | None = None) -> list:
    """Episodes advancing together turn by turn: each next prompt is the context so far, the
    answer and an observation of 1-4 tokens (so new-token lengths differ between rows)."""
    contexts = [tuple([1, *range(2 + k, 6 + 2 * k)]) for k in range(episodes)]
    out: list[list[Completion]] = [[] for _ in range(episodes)]
    for turn in range(turns):
        if turn == load_after:
            engine.update_weights(dict(engine.model.state_dict()), engine.version + 1)
        futures = [
            engine.submit(_turn(f"e{k}-t{turn}", ctx, f"e{k}", 100 * k + turn)) for k, ctx in enumerate(contexts)
        ]
        while engine.has_work():
            engine.step()
        for k, future in enumerate(futures):
            c = future.result()
            out[k].append(c)
            contexts[k] = c.prompt_ids + c.token_ids + tuple(range(3, 4 + (k + turn) % 4))
    return out


def _same(a: list, b: list) -> None:
    for ea, eb in zip(a, b, strict=True):
        for ca, cb in zip(ea, eb, strict=True):
            assert ca.token_ids == cb.token_ids
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)


def test_a_sessions_next_turn_computes_only_its_new_tokens(model: LlamaForCausalLM) -> None:
    full = HFInferenceEngine(model, max_batch=8)
    reused = HFInferenceEngine(model, max_batch=8, session_cache_mib=16)
    _same(_episodes(full), _episodes(reused))
    f, r = full.stats(), reused.stats()
    assert r["session_hits"] == 12 and r["session_kept"] == 18  # turns 2 and 3 of six episodes
    assert r["prefill_tokens"] + r["session_hit_tokens"] == f["prefill_tokens"]
    assert r["prefill_tokens"] < f["prefill_tokens"] / 2
    assert r["prefills"] == 1 + 2  # first turns: one left-padded forward; later turns: one each


def test_a_weight_load_between_turns_prefills_the_whole_context(model: LlamaForCausalLM) -> None:
    reused = HFInferenceEngine(model, max_batch=8, session_cache_mib=16)
    _episodes(reused, load_after=1)
    s = reused.stats()
    assert s["session_hits"] == 6  # turn 2 (after the load) missed, turn 3 hit
    assert s["session_dropped"] == 6


def test_a_prompt_that_does_not_extend_the_kept_turn_is_prefilled_in_full(model: LlamaForCausalLM) -> None:
    engine = HFInferenceEngine(model, max_batch=4, session_cache_mib=16)
    first = engine.submit(_turn("a-t0", (1, 2, 3, 4), "a", 1))
    while engine.has_work():
        engine.step()
    changed = (1, 2, 9, 4, *first.result().token_ids, 5)  # history re-rendered differently
    alone = HFInferenceEngine(model, max_batch=4)
    got, want = (e.submit(_turn("a-t1", changed, "a", 2)) for e in (engine, alone))
    for e in (engine, alone):
        while e.has_work():
            e.step()
    assert engine.stats()["session_hits"] == 0
    assert got.result().token_ids == want.result().token_ids


def test_continue_prefill_equals_a_full_prefill(model: LlamaForCausalLM) -> None:
    prompts = [(1, 2, 3, 4, 5, 6, 7), (8, 9, 10), (11, 12, 13, 14, 15)]
    kept_lengths = [4, 2, 3]
    turns = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, kept_lengths, strict=True):
            cache, mask, _, _ = prefill(model, [prompt[:n]])
            kv = tuple(getattr(layer, a)[0] for a in ("keys", "values") for layer in cache.layers)
            turns.append(KeptTurn(prompt[:n], kv, mask[0]))
        _, mask, logits, computed = continue_prefill(model, turns, prompts)
        _, _, want, _ = prefill(model, prompts)
    assert computed == sum(len(p) - n for p, n in zip(prompts, kept_lengths, strict=True))
    assert mask.sum(1).tolist() == [len(p) for p in prompts]
    assert torch.allclose(logits, want, atol=1e-4)


def test_kept_turns_leave_least_recent_first_past_the_memory_cap() -> None:
    def turn(n: int) -> KeptTurn:
        return KeptTurn(tuple(range(n)), (torch.zeros(1, n, 4),), torch.ones(n, dtype=torch.long))

    cache = SessionCache(max_bytes=3 * 12 * 4)  # three 3-token turns of 12 floats each
    for name in "abcd":
        cache.keep(name, turn(3))
    assert len(cache) == 3 and cache.counts["session_dropped"] == 1
    assert cache.take("a", tuple(range(5))) is None  # dropped
    assert cache.take("b", (0, 1, 2)) is None  # does not extend it (and it leaves)
    assert cache.take("c", (0, 1, 2, 7)) is not None and len(cache) == 1
