"""The direct ``chat.completions.create`` of the clients sluice hands its agents
(``rollout/agent_client.py``): the same request and the same answer object as the ``openai``
client's own path, which still takes every call that is not plain."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from sluice.rollout.agent_client import direct_chat
from sluice.rollout.agent_transport import _transports, httpx_module

BASE_URL = "http://127.0.0.1:9/v1/episode-key/"
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "37*48"}]
ANSWER = {
    "id": "chatcmpl-3",
    "object": "chat.completion",
    "created": 1764300000,
    "model": "policy",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "logprobs": None,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"e": 1}'}}
                ],
            },
        }
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
}
REFUSED = {"error": {"message": "n must be 1", "type": "invalid_request_error", "code": "n"}}


class Recorder:
    """An answer function (both the transport's and the direct path's): records each call by path."""

    def __init__(self, status: int = 200, payload: dict | None = None) -> None:
        self.status, self.payload = status, payload or ANSWER
        self.calls: list[tuple[str, str, str | None, dict]] = []

    def via(self, route: str):
        def answer(path, authorization, body):
            self.calls.append((route, path, authorization, json.loads(body)))
            return self.status, self.payload

        async def answer_async(path, authorization, body):
            return answer(path, authorization, body)

        return answer_async, answer


def _clients(recorder: Recorder, sync: bool):
    """(the plain ``openai`` client over the in-process transport, the same with the direct path)."""
    client_async, client_sync = recorder.via("client")
    transport_async, transport_sync = _transports(httpx_module(openai), client_async, client_sync)
    direct_async, direct_sync = recorder.via("direct")

    def make():
        if sync:
            return openai.OpenAI(base_url=BASE_URL, api_key="episode-key", max_retries=0,
                                 http_client=openai.DefaultHttpxClient(transport=transport_sync))  # fmt: skip
        return openai.AsyncOpenAI(base_url=BASE_URL, api_key="episode-key", max_retries=0,
                                  http_client=openai.DefaultAsyncHttpxClient(transport=transport_async))  # fmt: skip

    direct = direct_chat(openai, make(), answer=direct_sync) if sync else direct_chat(openai, make(), direct_async)
    return make(), direct


def _create(client, sync: bool, **kwargs):
    if sync:
        return client.chat.completions.create(**kwargs)
    return asyncio.run(client.chat.completions.create(**kwargs))


@pytest.mark.parametrize("sync", [False, True])
def test_a_plain_call_sends_the_clients_request_and_returns_its_answer(sync):
    recorder = Recorder()
    plain, direct = _clients(recorder, sync)
    kwargs = {"model": "policy", "messages": MESSAGES, "tools": TOOLS, "temperature": 1.0, "max_tokens": 8,
              "top_p": openai.NOT_GIVEN, "stop": openai.omit}  # fmt: skip
    theirs, ours = _create(plain, sync, **kwargs), _create(direct, sync, **kwargs)
    (route_a, *request_a), (route_b, *request_b) = recorder.calls
    assert (route_a, route_b) == ("client", "direct")
    assert request_a == request_b  # path, Authorization, JSON body
    assert request_b[0] == "/v1/episode-key/chat/completions" and "top_p" not in request_b[2]
    assert type(ours) is type(theirs) is openai.types.chat.ChatCompletion
    assert ours == theirs and ours.model_dump() == theirs.model_dump()
    assert ours.choices[0].message.tool_calls[0].function.arguments == '{"e": 1}'


@pytest.mark.parametrize("sync", [False, True])
def test_an_error_answer_raises_what_the_client_raises(sync):
    recorder = Recorder(400, REFUSED)
    plain, direct = _clients(recorder, sync)
    raised = []
    for client in (plain, direct):
        with pytest.raises(openai.BadRequestError) as err:
            _create(client, sync, model="policy", messages=MESSAGES)
        raised.append(err.value)
    assert [c[0] for c in recorder.calls] == ["client", "direct"]
    assert str(raised[0]) == str(raised[1]) and raised[0].body == raised[1].body and raised[1].status_code == 400


@pytest.mark.parametrize(
    "kwargs",
    [
        {"messages": [openai.types.chat.ChatCompletionMessage(role="assistant", content="a1")]},  # a pydantic message
        {"messages": (m for m in MESSAGES)},  # an iterable that is not a list
        {"messages": MESSAGES, "extra_body": {"top_k": 3}},
        {"messages": MESSAGES, "timeout": 5.0},
    ],
    ids=["pydantic", "generator", "extra_body", "timeout"],
)
def test_a_call_that_is_not_plain_takes_the_clients_path(kwargs):
    recorder = Recorder()
    _, direct = _clients(recorder, sync=False)
    assert _create(direct, False, model="policy", **kwargs).choices[0].finish_reason == "tool_calls"
    assert [c[0] for c in recorder.calls] == ["client"]
