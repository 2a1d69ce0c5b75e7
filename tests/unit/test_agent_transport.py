"""The in-process transport under the agents' ``openai`` clients: calls reach the endpoint without
the HTTP server, give the same token records as over HTTP, get the same OpenAI errors, and a
call in flight is aborted on the engine when its episode times out."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fakes
from sluice.api import PromptItem, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.rollout.agent_runner import AgentEpisodeRunner
from sluice.rollout.agent_session import AgentSession, ChatModel, SessionLimits
from sluice.rollout.envs import TINY_CHAT_TEMPLATE
from sluice.rollout.episode import EpisodeFailed
from sluice.rollout.tool_parsers import TOOL_PARSERS
from sluice.tasks import TASKS
from sluice.tasks.tiny_model import build_char_tokenizer

TOK = build_char_tokenizer(TASKS["calculator"].alphabet, chat_template=TINY_CHAT_TEMPLATE)


def _engine() -> HFInferenceEngine:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)  # fmt: skip
    return HFInferenceEngine(LlamaForCausalLM(config).float().eval(), max_batch=16)


def _runner(engine, transport="in_process", agent="fakes:calculator_agent", timeout=30.0, process=False):
    limits = SessionLimits(max_turns=3, max_context=128, turn_tokens=8,
                           params=SamplingParams(8, 1.0, 1.0, (TOK.eos_token_id,)))  # fmt: skip
    model = ChatModel(TOK, TINY_CHAT_TEMPLATE, TOOL_PARSERS["calculator"])
    return AgentEpisodeRunner(engine, agent, model, limits, reward=None, timeout_s=timeout, run_seed=3,
                              transport=transport, process=process)  # fmt: skip


def _item(index: int) -> PromptItem:
    a, b = 10 + index, 20 + 3 * index
    return PromptItem(index, f"{a}*{b}", (), {"a": a, "b": b, "answer": str(a * b)})


def _play(runner: AgentEpisodeRunner, n: int = 8) -> list:
    async def main():
        return await asyncio.gather(*(runner.run(_item(i), group_id=i // 4, k=i % 4) for i in range(n)))

    try:
        return asyncio.run(main())
    finally:
        runner.close()


def test_in_process_calls_skip_the_server_and_record_what_http_records():
    in_process, http = _runner(_engine()), _runner(_engine(), transport="http")
    near, far = _play(in_process), _play(http)
    assert in_process.counts["calls"] >= 8 and in_process.endpoint.http_calls == 0  # no socket was used
    assert http.endpoint.http_calls == http.counts["calls"] == in_process.counts["calls"]
    for a, b in zip(near, far, strict=True):
        assert (a.prompt_ids, a.response_ids, a.loss_mask, a.reward) == (b.prompt_ids, b.response_ids, b.loss_mask,
                                                                         b.reward)  # fmt: skip
        assert a.behav_logprobs == pytest.approx(b.behav_logprobs, abs=1e-5) and a.token_versions == b.token_versions


@pytest.mark.parametrize("process", [False, True])
def test_a_sync_agent_skips_the_server_too(process):
    runner = _runner(fakes.FakeInferenceEngine(vocab=len(TOK)), agent="fakes:sync_calculator_agent", process=process)
    samples = _play(runner, 3)
    assert len(samples) == 3 and runner.counts["calls"] == 3 and runner.endpoint.http_calls == 0


def test_the_in_process_client_gets_the_endpoints_errors():
    engine = fakes.FakeInferenceEngine(vocab=len(TOK))
    runner = _runner(engine)
    body = {"model": "m", "messages": [{"role": "user", "content": "12*34"}], "max_tokens": 3}

    async def calls(key: str) -> list[BaseException | int]:
        http = runner._http_client(sync=False)
        good = openai.AsyncOpenAI(base_url=runner.endpoint.base_url(key), api_key=key, max_retries=0, http_client=http)
        unknown = openai.AsyncOpenAI(base_url=runner.endpoint.base_url("nokey"), api_key="x", max_retries=0,
                                     http_client=http)  # fmt: skip
        results: list[BaseException | int] = [len((await good.chat.completions.create(**body)).choices)]
        for call in (unknown.chat.completions.create(**body), good.chat.completions.create(**body, stream=False, n=2),
                     good.models.list()):  # fmt: skip
            try:
                await call
            except openai.APIStatusError as err:
                results.append(err)
        await http.aclose()
        return results

    async def main():
        session = AgentSession(engine, runner.model, runner.limits, run_seed=0, group_id=0, k=0)
        return await asyncio.wrap_future(runner.agents.submit(calls(runner.endpoint.open(session))))

    try:
        ok, unknown, two, get = asyncio.run(main())
    finally:
        runner.close()
    assert ok == 1
    assert isinstance(unknown, openai.AuthenticationError) and "key" in str(unknown)
    assert isinstance(two, openai.BadRequestError) and "n=1" in str(two)
    assert get.status_code == 405  # type: ignore[union-attr]
    assert runner.endpoint.errors == 2 and runner.endpoint.http_calls == 0  # the GET never reached it


def test_a_call_in_flight_is_aborted_when_its_episode_times_out():
    engine = _engine()
    engine.pause()  # requests queue and never finish
    runner = _runner(engine, timeout=0.5)

    async def main():
        with pytest.raises(EpisodeFailed, match="agent_timeout"):
            await runner.run(_item(0), 0, 0)
        await asyncio.sleep(0.1)  # the cancellation reaches the engine's loop

    try:
        asyncio.run(main())
    finally:
        runner.close()
    assert not engine.has_work() and runner.counts["calls"] == 0


def test_agents_in_their_own_process_record_what_in_thread_agents_record():
    import os

    own, threaded = _runner(_engine(), process=True), _runner(_engine())
    apart, here = _play(own), _play(threaded)
    assert own.counts["calls"] == threaded.counts["calls"] >= 8 and own.endpoint.http_calls == 0  # over its pipe
    for a, b in zip(apart, here, strict=True):
        assert (a.prompt_ids, a.response_ids, a.loss_mask, a.reward) == (b.prompt_ids, b.response_ids, b.loss_mask,
                                                                         b.reward)  # fmt: skip
    pids = _runner(fakes.FakeInferenceEngine(vocab=len(TOK)), agent="fakes:pid_agent", process=True)
    (sample,) = _play(pids, 1)
    assert sample.reward not in (0.0, float(os.getpid()))


def test_an_agent_process_reports_failures_and_timeouts():
    engine = _engine()
    runner = _runner(engine, process=True)
    stalled = _runner(_engine(), process=True, timeout=0.5)
    stalled.engine.pause()

    async def main():
        with pytest.raises(EpisodeFailed, match=r"agent_error.*agent bug"):
            await runner.run(PromptItem(0, "1*2", (), {"a": 1, "b": 2, "raise": True}), 0, 0)
        with pytest.raises(EpisodeFailed, match="agent_timeout"):
            await stalled.run(_item(1), 0, 1)
        await asyncio.sleep(0.1)
        return await runner.run(_item(2), 0, 2)

    try:
        sample = asyncio.run(main())
    finally:
        runner.close()
        stalled.close()
    assert sample.meta["calls"] >= 1 and not stalled.engine.has_work()


def test_a_dead_agent_process_fails_its_episodes_at_once():
    """The engine's loop reads the child's pipe: when the child dies, every episode it held fails
    (``agent_error`` naming the exit), without waiting for a timeout."""
    runner = _runner(_engine(), process=True, timeout=30.0)
    runner.engine.pause()  # the episodes' calls wait: the agents are mid-episode when the child dies

    async def main():
        episodes = [asyncio.ensure_future(runner.run(_item(i), 0, i)) for i in range(3)]
        while runner.engine.stats()["waiting"] < 3:
            await asyncio.sleep(0.01)
        runner.process._process.kill()
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*episodes, return_exceptions=True)
        return results, asyncio.get_running_loop().time() - started

    try:
        results, took = asyncio.run(main())
    finally:
        runner.close()
    assert all(isinstance(r, EpisodeFailed) and "exited" in str(r) for r in results), results
    assert took < 10.0


def test_an_agent_process_serves_successive_event_loops():
    """A runner played under one ``asyncio.run`` and then another: the pipe's reader moves to the
    new loop (the first is closed), so the second loop's episodes are answered too."""
    runner = _runner(_engine(), process=True)

    async def one(i):
        return await runner.run(_item(i), 0, i)

    try:
        first, second = asyncio.run(one(0)), asyncio.run(one(1))
    finally:
        runner.close()
    assert first.meta["calls"] >= 1 and second.meta["calls"] >= 1
