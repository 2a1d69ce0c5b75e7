"""Engines waiting for agent calls known to be on their way (``agentic.hold_for_calls``): the
sessions count the calls (only after an answer that calls a tool, until the next call or the
episode's end), the hold waits while they outnumber the batch and steps as soon as they arrive,
never longer than its bound, and a held engine samples exactly what an unheld one does."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from fakes import ScriptedTurnsEngine
from sluice.api import ExpectsRequests, GenerationRequest, SamplingParams
from sluice.engines.arrival_hold import ArrivalHold
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.rollout.agent_session import AgentSession, ChatModel, ChatRequest, ExpectedCalls, SessionLimits
from sluice.rollout.envs import TINY_CHAT_TEMPLATE
from sluice.rollout.tool_parsers import TOOL_PARSERS
from sluice.tasks import TASKS
from sluice.tasks.tiny_model import build_char_tokenizer
from tiny import tiny_llama

TOK = build_char_tokenizer(TASKS["calculator"].alphabet, chat_template=TINY_CHAT_TEMPLATE)
END = TOK.eos_token_id
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def _session(engine: ScriptedTurnsEngine, expected: ExpectedCalls, max_turns: int = 3) -> AgentSession:
    limits = SessionLimits(max_turns, 128, 8, SamplingParams(8, 1.0, 1.0, (END,)))
    model = ChatModel(TOK, TINY_CHAT_TEMPLATE, TOOL_PARSERS["calculator"])
    return AgentSession(engine, model, limits, run_seed=0, group_id=0, k=0, expected=expected)  # type: ignore[arg-type]


def test_a_session_expects_a_call_only_after_answering_a_tool_call_until_it_comes_or_the_episode_ends() -> None:
    call = [*TOK.encode("c3*4", add_special_tokens=False), END]
    answer = [*TOK.encode("a12", add_special_tokens=False), END]

    async def main() -> list[float]:
        expected = ExpectedCalls()
        first = _session(ScriptedTurnsEngine([call, answer]), expected)
        other = _session(ScriptedTurnsEngine([call]), expected)
        seen = []
        messages = [{"role": "user", "content": "3*4"}]
        reply = await first.complete(ChatRequest(messages=messages, tools=TOOLS))
        seen.append(expected())  # a tool call answered: its result comes back as the next call
        await other.complete(ChatRequest(messages=messages, tools=TOOLS))
        seen.append(expected())
        tool_call = reply["choices"][0]["message"]["tool_calls"][0]
        messages += [reply["choices"][0]["message"], {"role": "tool", "tool_call_id": tool_call["id"], "content": "12"}]
        await first.complete(ChatRequest(messages=messages, tools=TOOLS))
        seen.append(expected())  # the call came; its answer is text: the agent is done, nothing expected
        other.abort()  # the other episode ended (its agent returned, failed or was stopped)
        seen.append(expected())
        return seen

    assert asyncio.run(main()) == [1.0, 2.0, 1.0, 0.0]


def test_a_session_at_max_turns_expects_no_further_call() -> None:
    call = [*TOK.encode("c3*4", add_special_tokens=False), END]

    async def main() -> float:
        expected = ExpectedCalls()
        await _session(ScriptedTurnsEngine([call]), expected, max_turns=1).complete(
            ChatRequest(messages=[{"role": "user", "content": "3*4"}], tools=TOOLS)
        )
        return expected()

    assert asyncio.run(main()) == 0.0


def test_the_hold_waits_while_expected_calls_outnumber_the_batch_and_returns_when_they_arrive() -> None:
    async def main() -> tuple[float, float, float, int]:
        coming = [3]
        hold = ArrivalHold(lambda: coming[0], hold=50.0)
        hold.stepped(0.01)  # bound: 0.5 s
        arrived = asyncio.Event()
        batch = [1]

        async def arrive() -> None:
            await asyncio.sleep(0.02)
            coming[0], batch[0] = 0, 4  # the calls came in: now in the batch
            arrived.set()

        task = asyncio.create_task(arrive())
        start = time.perf_counter()
        await hold.wait(lambda: batch[0], arrived)
        waited = time.perf_counter() - start
        await task
        start = time.perf_counter()
        coming[0] = 9  # never arrive: the bound ends the wait
        await hold.wait(lambda: batch[0], asyncio.Event())
        bounded = time.perf_counter() - start
        start = time.perf_counter()
        coming[0] = 4  # not more than the batch: no wait
        await hold.wait(lambda: batch[0], asyncio.Event())
        return waited, bounded, time.perf_counter() - start, hold.holds

    waited, bounded, not_held, holds = asyncio.run(main())
    assert 0.015 < waited < 0.4  # woke at the arrival, long before the bound
    assert 0.45 < bounded < 1.5
    assert not_held < 0.01 and holds == 2


def test_a_held_engine_samples_exactly_what_an_unheld_one_does() -> None:
    torch.set_num_threads(1)
    model = tiny_llama(0)
    requests = [
        GenerationRequest(f"r{i}", tuple(range(1, 3 + i)), SamplingParams(6, 1.0, 1.0, ()), seed=i) for i in range(6)
    ]

    async def run(engine: HFInferenceEngine) -> list[tuple[int, ...]]:
        first = [asyncio.ensure_future(engine.generate(r)) for r in requests[:3]]
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(engine.generate(r)) for r in requests[3:]]
        return [c.token_ids for c in await asyncio.gather(*first, *rest)]

    held = HFInferenceEngine(model, max_batch=8)
    assert isinstance(held, ExpectsRequests)
    held.expect_requests(lambda: 100.0, hold=2.0)  # calls always "on their way": every step waits its bound
    plain = HFInferenceEngine(model, max_batch=8)
    assert asyncio.run(run(held)) == asyncio.run(run(plain))
    stats = held.stats()
    assert stats["holds"] > 0 and stats["hold_s"] > 0
    assert plain.stats()["holds"] == plain.stats()["hold_s"] == 0


def test_hold_zero_never_waits_and_a_negative_hold_is_refused() -> None:
    engine = HFInferenceEngine(tiny_llama(0), max_batch=2)
    engine.expect_requests(lambda: 100.0, hold=0.0)
    request = GenerationRequest("r", (1, 2), SamplingParams(3, 1.0, 1.0, ()), seed=0)
    asyncio.run(engine.generate(request))
    assert engine.stats()["holds"] == 0
    with pytest.raises(ValueError, match="hold"):
        ArrivalHold(lambda: 1.0, hold=-1.0)
