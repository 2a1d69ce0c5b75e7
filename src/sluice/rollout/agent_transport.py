"""The in-process transport of the clients sluice hands its agents: an OpenAI call without a socket.

The ``openai`` client an agent is given (``agent_runner.py``) has ``base_url`` its episode's
endpoint, as any client would, but its HTTP client's transport is ``EndpointTransport`` (async
agents) or ``EndpointSyncTransport`` (sync ones): the request the ``openai`` client built (method,
path with the episode's key, ``Authorization``, JSON body) goes straight to
``AgentEndpoint.answer_async`` / ``answer`` (the same routing, validation, session and error
answers as the HTTP server) and comes back as an ``httpx`` response with the JSON body. Why: over
loopback each call paid the HTTP client's connection pool and socket I/O, the server thread's
parsing and a thread hand-off, all on the rollout worker's GIL (measured: most of an agent
call's CPU on the tiny calculator model; ``docs/agentic.md``). The HTTP server stays for agents
that build their own client from ``base_url``. ``pipe_transports`` does the same for agents in a
process of their own (``agent_process.py``): a call goes down its pipe, the answer comes back up.
Not here: streaming (the endpoint refuses it),
requests other than ``POST`` (answered 405, as the server has no other route).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the agents' process imports this module without the endpoint's (pydantic, sluice.api)
    from sluice.rollout.agent_endpoint import AgentEndpoint


def httpx_module(openai: Any) -> Any:
    """The ``httpx`` package the ``openai`` client is built on (``httpx2`` in newer releases)."""
    base = next(c for c in type.mro(openai.DefaultAsyncHttpxClient) if c.__name__ == "AsyncClient")
    return __import__(base.__module__.split(".")[0])


def transports(endpoint: AgentEndpoint, openai: Any) -> tuple[Any, Any]:
    """(async transport, sync transport) answering calls through ``endpoint`` in process."""
    return _transports(httpx_module(openai), endpoint.answer_async, endpoint.answer)


class PipeCalls:
    """The agents' process's side of calls carried over its pipe to the rollout worker
    (``agent_process.py``): ``send`` a ``("call", id, path, authorization, body)``, wait for
    ``answer(id, status, payload)`` (called by the pipe's reader thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[tuple[Any, ...]], None]) -> None:
        self.loop, self.send = loop, send
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any] | concurrent.futures.Future[Any]] = {}

    async def call_async(self, path: str, authorization: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        call, future = next(self._ids), self.loop.create_future()
        self._pending[call] = future
        try:
            self.send(("call", call, path, authorization, body))
            return await future  # type: ignore[no-any-return]
        finally:
            self._pending.pop(call, None)

    def call(self, path: str, authorization: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        call, future = next(self._ids), concurrent.futures.Future[Any]()
        self._pending[call] = future
        try:
            self.send(("call", call, path, authorization, body))
            return future.result()  # type: ignore[no-any-return]
        finally:
            self._pending.pop(call, None)

    def answer(self, call: int, status: int, payload: dict[str, Any]) -> None:
        future = self._pending.get(call)
        if isinstance(future, concurrent.futures.Future):
            future.set_result((status, payload))
        elif future is not None:
            self.loop.call_soon_threadsafe(_settle, future, (status, payload))


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():  # an agent cancelled while its answer was on the way
        future.set_result(value)


def pipe_transports(
    openai: Any, loop: asyncio.AbstractEventLoop, send: Callable[[tuple[Any, ...]], None]
) -> tuple[PipeCalls, tuple[Any, Any]]:
    """The agents' process's calls and (async, sync) transports sending them over its pipe."""
    calls = PipeCalls(loop, send)
    return calls, _transports(httpx_module(openai), calls.call_async, calls.call)


def _transports(httpx: Any, answer_async: Callable[..., Any], answer: Callable[..., Any]) -> tuple[Any, Any]:
    def response(request: Any, status: int, payload: dict[str, Any]) -> Any:
        headers = {"content-type": "application/json"}
        return httpx.Response(status, headers=headers, content=json.dumps(payload).encode(), request=request)

    def refused(request: Any) -> Any:
        message = f"{request.method} is not served: POST /v1/<key>/chat/completions"
        return response(request, 405, {"error": {"message": message, "type": "invalid_request_error",
                                                 "code": "method"}})  # fmt: skip

    class EndpointTransport(httpx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        async def handle_async_request(self, request: Any) -> Any:
            if request.method != "POST":
                return refused(request)
            body = await request.aread()
            status, payload = await answer_async(request.url.path, request.headers.get("authorization"), body)
            return response(request, status, payload)

    class EndpointSyncTransport(httpx.BaseTransport):  # type: ignore[misc,name-defined]
        def handle_request(self, request: Any) -> Any:
            if request.method != "POST":
                return refused(request)
            status, payload = answer(request.url.path, request.headers.get("authorization"), request.read())
            return response(request, status, payload)

    return EndpointTransport(), EndpointSyncTransport()
