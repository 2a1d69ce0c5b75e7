"""The OpenAI-compatible endpoint and agents by import path, on the real HF engine with a tiny
model: concurrent episodes never mix, recorded tokens are bit-exactly what the engine sampled
(across an ``interrupt`` weight update, with per-token versions), a template that re-renders
history differently is detected and counted, and agent failures / timeouts fail their episode."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fakes
from fakes import RecordingEngine
from sluice.api import PromptItem, RewardFailure, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.rollout.agent_runner import AgentEpisodeRunner
from sluice.rollout.agent_session import ChatModel, SessionLimits
from sluice.rollout.envs import TINY_CHAT_TEMPLATE
from sluice.rollout.episode import EpisodeFailed
from sluice.rollout.tool_parsers import TOOL_PARSERS
from sluice.tasks import TASKS
from sluice.tasks.tiny_model import build_char_tokenizer

TOK = build_char_tokenizer(TASKS["calculator"].alphabet, chat_template=TINY_CHAT_TEMPLATE)
FORGETFUL = TINY_CHAT_TEMPLATE.replace(">{{ m['content'] or '' }}", ">{{ (m['content'] or '')[1:] }}")
"""Re-renders every earlier assistant text without its first character: history never matches."""


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config).float().eval()


def _runner(engine, agent="fakes:calculator_agent", template=TINY_CHAT_TEMPLATE, mismatch="refuse", timeout=30.0,
            reward=None) -> AgentEpisodeRunner:  # fmt: skip
    limits = SessionLimits(max_turns=3, max_context=128, turn_tokens=8,
                           params=SamplingParams(8, 1.0, 1.0, (TOK.eos_token_id,)), mismatch=mismatch)  # fmt: skip
    model = ChatModel(TOK, template, TOOL_PARSERS["calculator"])
    return AgentEpisodeRunner(engine, agent, model, limits, reward=reward, timeout_s=timeout, run_seed=5)


def _item(index: int, **fields) -> PromptItem:
    a, b = 10 + index, 20 + 3 * index
    return PromptItem(index, f"{a}*{b}", (), {"a": a, "b": b, "answer": str(a * b), **fields})


def _check_exact(sample, completions) -> None:
    """Every completion of the episode sits in the sample where its prompt ended, bit-exactly;
    everything else is template/env tokens (mask 0) carrying the previous token's version."""
    full = sample.prompt_ids + sample.response_ids
    sampled = set()
    for c in completions:
        start = len(c.prompt_ids) - len(sample.prompt_ids)
        assert full[: len(c.prompt_ids)] == c.prompt_ids  # the engine saw exactly the recorded context
        end = start + len(c.token_ids)
        assert sample.response_ids[start:end] == c.token_ids
        assert sample.behav_logprobs[start:end] == c.logprobs
        assert sample.token_versions[start:end] == c.versions
        assert sample.loss_mask[start:end] == (1,) * len(c.token_ids)
        sampled.update(range(start, end))
    rest = [i for i in range(len(sample.response_ids)) if i not in sampled]
    assert all(sample.loss_mask[i] == 0 and sample.behav_logprobs[i] == 0.0 for i in rest)
    assert sum(sample.loss_mask) == sum(len(c.token_ids) for c in completions)


def test_concurrent_episodes_record_exactly_what_was_sampled_across_an_interrupt_update():
    engine = HFInferenceEngine(_model(), max_batch=8)
    recording = RecordingEngine(engine)
    runner = _runner(recording)
    new = {n: p + 0.3 * torch.randn_like(p) for n, p in _model(1).state_dict().items()}

    async def main():
        async def update_midway():
            while engine.stats()["generated_tokens"] < 40:
                await asyncio.sleep(0.001)
            engine.update_weights(new, version=1, mode="interrupt")

        updater = asyncio.ensure_future(update_midway())
        samples = await asyncio.gather(*(runner.run(_item(i), group_id=i // 4, k=i % 4) for i in range(12)))
        await updater
        return samples

    try:
        samples = asyncio.run(main())
    finally:
        runner.close()
    assert runner.counts["mismatches"] == 0 and runner.counts["calls"] == len(recording.completions)
    versions = set()
    for i, sample in enumerate(samples):
        request_prefix = f"g{i // 4}-e{i % 4}-c"
        own = [c for c in recording.completions if c.request_id.startswith(request_prefix)]
        assert own and sample.meta["calls"] == len(own)
        assert sample.prompt_ids == tuple(TOK.encode(f"{_item(i).prompt}>"))  # its own row, nobody else's
        _check_exact(sample, own)
        versions.update(sample.token_versions)
    assert versions == {0, 1}  # tokens before and after the interrupt update, each with its version


def test_a_template_that_rerenders_history_is_detected_and_counted():
    engine = fakes.FakeInferenceEngine(vocab=len(TOK))
    refuse = _runner(fakes.FakeInferenceEngine(vocab=len(TOK)), agent="fakes:two_turn_agent", template=FORGETFUL)
    restart = _runner(engine, agent="fakes:two_turn_agent", template=FORGETFUL, mismatch="restart")
    exact = _runner(fakes.FakeInferenceEngine(vocab=len(TOK)), agent="fakes:two_turn_agent")

    async def play(runner):
        return await asyncio.gather(*(runner.run(_item(i), 0, i) for i in range(6)), return_exceptions=True)

    try:
        refused, restarted, matched = asyncio.run(play(refuse)), asyncio.run(play(restart)), asyncio.run(play(exact))
    finally:
        for runner in (refuse, restart, exact):
            runner.close()
    # a first reply that is more than its closing token loses a character when re-rendered
    diverging = [i for i, s in enumerate(matched) if len(s.response_ids) and s.loss_mask.index(0) > 1]
    assert diverging and exact.counts["mismatches"] == 0 and all(s.meta["calls"] == 2 for s in matched)
    failed = [i for i, r in enumerate(refused) if isinstance(r, EpisodeFailed)]
    assert failed == diverging and all(refused[i].reason == "template_mismatch" for i in failed)
    assert refuse.counts["mismatches"] == len(failed)  # counted, once per refused call
    assert not any(isinstance(r, Exception) for r in restarted)
    assert restart.counts["mismatches"] == restart.counts["segments"] == len(failed)
    for i in failed:  # the new segment starts from the second call's prompt: the first turn is dropped
        assert restarted[i].prompt_ids == engine_prompt(engine, f"g0-e{i}-c1")
        assert sum(restarted[i].loss_mask) < sum(matched[i].loss_mask)


def engine_prompt(engine, request_id: str) -> tuple[int, ...]:
    (request,) = [r for r in engine.requests if r.request_id == request_id]
    return request.prompt_ids


def test_agent_errors_timeouts_and_rewards():
    engine = fakes.FakeInferenceEngine(vocab=len(TOK))

    scored = []

    async def reward(response, **fields):
        scored.append((response, fields["answer"]))
        return 7.0

    async def broken(response, **fields):
        raise RewardFailure("error", "broken", "ValueError: boom")

    runner = _runner(engine, timeout=0.5, reward=reward)
    deferring = _runner(engine, agent="fakes:deferring_agent", reward=reward)
    unscorable = _runner(engine, agent="fakes:deferring_agent", reward=broken)

    async def main():
        with pytest.raises(EpisodeFailed, match=r"agent_error.*agent bug"):
            await runner.run(_item(0, **{"raise": True}), 0, 0)
        with pytest.raises(EpisodeFailed, match="agent_timeout"):
            await runner.run(_item(1, stall=5.0), 0, 1)
        with pytest.raises(EpisodeFailed, match=r"reward_error.*boom"):
            await unscorable.run(_item(3), 0, 3)
        return await deferring.run(_item(2), 0, 2)

    try:
        deferred = asyncio.run(main())
    finally:
        for each in (runner, deferring, unscorable):
            each.close()
    assert deferred.reward == 7.0  # None → the run's reward function, on the last turn's text
    (request,) = [r for r in engine.requests if r.request_id == "g0-e2-c0"]
    last = deferred.response_ids
    assert scored == [(deferring.model.decode(_closed(last, TOK.eos_token_id)), _item(2).fields["answer"])]
    assert runner.counts["calls"] == 0 and deferring.counts["calls"] == 1 and request.prompt_ids == deferred.prompt_ids


def _closed(ids, eos):
    return ids[:-1] if ids and ids[-1] == eos else ids


def test_sync_agent_runs_in_the_agent_thread_pool():
    engine = fakes.FakeInferenceEngine(vocab=len(TOK))
    runner = _runner(engine, agent="fakes:sync_calculator_agent")
    fakes.SYNC_AGENT_THREADS.clear()

    async def main():
        return await asyncio.gather(*(runner.run(_item(i), 0, i) for i in range(3)))

    try:
        samples = asyncio.run(main())
    finally:
        runner.close()
    assert len(samples) == 3 and all(s.meta["calls"] == 1 for s in samples)
    assert len(fakes.SYNC_AGENT_THREADS) == 3 and all(n.startswith("agent") for n in fakes.SYNC_AGENT_THREADS)


def test_http_routes_keys_and_bad_requests():
    engine = fakes.FakeInferenceEngine(vocab=len(TOK))
    runner = _runner(engine)
    endpoint = runner.endpoint
    body = {"model": "m", "messages": [{"role": "user", "content": "12*34"}], "max_tokens": 3}

    async def main():
        from sluice.rollout.agent_session import AgentSession

        session = AgentSession(engine, runner.model, runner.limits, run_seed=0, group_id=0, k=0)
        other = AgentSession(engine, runner.model, runner.limits, run_seed=0, group_id=0, k=1)
        key, other_key = endpoint.open(session), endpoint.open(other)
        url = f"http://127.0.0.1:{endpoint.port}/v1"

        def post(path, payload, headers=None):
            return httpx.post(url + path, content=json.dumps(payload), headers=headers or {}, timeout=10)

        by_path = await asyncio.to_thread(post, f"/{key}/chat/completions", body)
        by_bearer = await asyncio.to_thread(post, "/chat/completions", body, {"Authorization": f"Bearer {other_key}"})
        resent = await asyncio.to_thread(post, f"/{key}/chat/completions", body)  # history without the reply
        unknown = await asyncio.to_thread(post, "/nokey/chat/completions", body)
        bad = await asyncio.to_thread(post, f"/{key}/chat/completions", {"messages": [], "temperature": -1})
        stream = await asyncio.to_thread(post, f"/{key}/chat/completions", {**body, "stream": True})
        return by_path, by_bearer, resent, unknown, bad, stream, session, other

    try:
        by_path, by_bearer, resent, unknown, bad, stream, session, other = asyncio.run(main())
    finally:
        runner.close()
    assert by_path.status_code == 200 and by_path.json()["choices"][0]["message"]["role"] == "assistant"
    assert by_path.json()["usage"]["prompt_tokens"] == len(TOK.encode("12*34>"))
    assert by_bearer.status_code == 200 and other.counts["calls"] == 1 and session.counts["calls"] == 1
    assert resent.status_code == 400 and resent.json()["error"]["code"] == "template_mismatch"
    assert session.counts["mismatches"] == 1 and session.failure == "template_mismatch"
    assert unknown.status_code == 401 and "key" in unknown.json()["error"]["message"]
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("messages:")
    assert stream.status_code == 400 and "stream" in stream.json()["error"]["message"]


def test_a_call_costs_milliseconds_not_a_delayed_ack():
    """Headers and body leave in two writes; with Nagle's algorithm on, each answer waits for the
    client's delayed ACK (~40 ms on Linux). The median keep-alive call stays far below that."""
    import dataclasses
    import statistics
    import time

    from sluice.rollout.agent_session import AgentSession

    engine = fakes.FakeInferenceEngine(vocab=len(TOK))
    runner = _runner(engine, mismatch="restart")
    body = {"messages": [{"role": "user", "content": "12"}], "max_tokens": 2}

    async def main():
        limits = dataclasses.replace(runner.limits, max_turns=100)  # every call restarts: same prompt
        session = AgentSession(engine, runner.model, limits, run_seed=0, group_id=0, k=0)
        url = runner.endpoint.base_url(runner.endpoint.open(session)) + "/chat/completions"

        def calls() -> list[float]:
            times = []
            with httpx.Client() as client:
                for _ in range(15):
                    started = time.perf_counter()
                    assert client.post(url, json=body, timeout=10).status_code == 200
                    times.append(time.perf_counter() - started)
            return times

        return await asyncio.to_thread(calls)

    try:
        times = asyncio.run(main())
    finally:
        runner.close()
    assert statistics.median(times) < 0.03


def test_a_group_failed_by_its_agent_names_the_agent():
    from sluice.queue import AsyncLocalQueue, LocalQueue
    from sluice.queue.samples import SAMPLE_COLUMNS
    from sluice.rollout.env_runner import ENV_FAILURE, EnvRunner

    queue = LocalQueue()
    queue.register_task("train", SAMPLE_COLUMNS)
    episodes = _runner(fakes.FakeInferenceEngine(vocab=len(TOK)))
    runner = EnvRunner(episodes, AsyncLocalQueue(queue), group_size=2, name="fakes:calculator_agent", role="agent")

    async def wave():
        return [r async for r in runner.run_groups([(_item(0, **{"raise": True}), 0)])]

    try:
        (report,) = asyncio.run(wave())
    finally:
        episodes.close()
    assert report.discard_reason == ENV_FAILURE
    assert report.failed_by == "agent 'fakes:calculator_agent'" and report.error.startswith("agent_error:")
    assert runner.stats()["env_episodes_agent_error"] >= 1.0 and runner.stats()["env_agent_calls"] == 0.0
