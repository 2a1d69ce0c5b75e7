"""The direct path of the ``openai`` clients sluice hands its agents: ``chat.completions.create``
without the client's HTTP machinery, for the calls that need none of it.

An agent's client (``agent_runner.py``, ``agent_process.py``) is a real ``openai.AsyncOpenAI`` /
``openai.OpenAI`` on its episode's ``base_url``. ``direct_chat`` gives its ``chat.completions`` a
``create`` that, when every argument is plain JSON (dicts, lists, strings, numbers: what an agent
builds its messages and tools from) and none of ``stream``, ``extra_headers``, ``extra_query``,
``extra_body``, ``timeout`` is given, serialises the arguments itself, hands the body to the same
answer function the client's transport would have reached (the endpoint in process, or the
agents' pipe) and builds the ``ChatCompletion`` from the answer with the response model's own
validation; an error answer raises the ``openai`` error the client would have raised (its own
status-to-exception mapping). Any other call (a pydantic message, a generator, streaming, extra
options) goes through the client's ``create`` unchanged. Why: the ``openai`` client's request
transformation, request building and ``httpx`` send cost ≈ 3 ms of CPU per call on this
machine (its ``_transform`` alone ≈ 45 %), more than the tiny model's engine step; the request
and the answer are the same (tested against the client's own path). AReaL's ``ArealOpenAI``
makes the same choice. Not here: the transports themselves (``agent_transport.py``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from sluice.rollout.agent_transport import httpx_module

Answer = tuple[int, dict[str, Any]]
CLIENT_ONLY = ("stream", "extra_headers", "extra_query", "extra_body", "timeout")
"""Arguments only the client's own path handles (their presence sends the call there)."""


def direct_chat(
    openai: Any,
    client: Any,
    answer_async: Callable[[str, str | None, bytes], Awaitable[Answer]] | None = None,
    answer: Callable[[str, str | None, bytes], Answer] | None = None,
) -> Any:
    """``client`` (async with ``answer_async``, sync with ``answer``) with the direct
    ``chat.completions.create``; returns it."""
    completions = client.chat.completions
    original = completions.create
    path = client.base_url.path.rstrip("/") + "/chat/completions"
    authorization = f"Bearer {client.api_key}"
    skip = (openai.NotGiven, openai.Omit)

    def body(kwargs: dict[str, Any]) -> bytes | None:
        """The request's JSON body; ``None``: the call is not plain (the client's path takes it)."""
        if any(name in kwargs for name in CLIENT_ONLY):
            return None
        try:
            return json.dumps({k: v for k, v in kwargs.items() if not isinstance(v, skip)}).encode()
        except (TypeError, ValueError):  # deliberately: not plain JSON, the client transforms it
            return None

    def result(status: int, payload: dict[str, Any]) -> Any:
        if status == 200:
            return openai.types.chat.ChatCompletion.model_validate(payload)
        httpx = httpx_module(openai)
        request = httpx.Request("POST", client.base_url.join("chat/completions"))
        raise client._make_status_error_from_response(httpx.Response(status, json=payload, request=request))

    if answer_async is not None:
        call_async = answer_async

        @functools.wraps(original)
        async def create_async(**kwargs: Any) -> Any:
            encoded = body(kwargs)
            if encoded is None:
                return await original(**kwargs)
            return result(*await call_async(path, authorization, encoded))

        completions.create = create_async
    elif answer is not None:
        call = answer

        @functools.wraps(original)
        def create(**kwargs: Any) -> Any:
            encoded = body(kwargs)
            return original(**kwargs) if encoded is None else result(*call(path, authorization, encoded))

        completions.create = create
    return client
