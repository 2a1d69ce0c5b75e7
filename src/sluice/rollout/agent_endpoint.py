"""The OpenAI-compatible HTTP endpoint of the rollout worker: ``POST /v1/chat/completions``.

``AgentEndpoint`` listens on loopback only (``127.0.0.1``, a free port) in a thread of its own
(the standard library's ``ThreadingHTTPServer``: one thread per connection, so a slow agent holds
no other). Every episode registers its ``AgentSession`` under a fresh random key; a call names
its session by the key in the path (``/v1/<key>/chat/completions``: ``base_url`` of the episode's
client is ``http://127.0.0.1:<port>/v1/<key>``) or by ``Authorization: Bearer <key>`` on
``/v1/chat/completions``, so concurrent episodes never mix. A call is validated (pydantic, one
clear message naming the field), then handed to the session on the engine's event loop and
answered when its turn is sampled. Errors are OpenAI-shaped JSON (``{"error": {"message",
"type", "code"}}``); an unknown or closed key is 401. It generates nothing itself
(``agent_session.py``) and runs no agent (``agent_runner.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import secrets
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import ValidationError

from sluice.rollout.agent_session import AgentSession, ChatRequest, EndpointError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_ROUTE = "chat/completions"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: every running episode may connect at once (default 5)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone before its answer (its episode was stopped) is expected; others are logged."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("agent endpoint: client %s left before its answer", client_address)
            return
        log.exception("agent endpoint: request from %s failed", client_address)


class AgentEndpoint:
    """Sessions by key behind one loopback HTTP server (see the module docstring)."""

    def __init__(self) -> None:
        self._sessions: dict[str, AgentSession] = {}
        self._guard = threading.Lock()
        self._server = _Server((HOST, 0), _handler(self))
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="agent-endpoint", daemon=True)
        self._thread.start()
        self.errors = 0
        """Calls answered with an error (any status)."""
        self.http_calls = 0
        """Calls that came over the HTTP server (the in-process transport's do not)."""

    def open(self, session: AgentSession) -> str:
        """Register ``session`` under a fresh key; returns the key."""
        key = secrets.token_urlsafe(12)
        with self._guard:
            self._sessions[key] = session
        return key

    def close_session(self, key: str) -> None:
        """Forget the key: later calls with it are refused (401)."""
        with self._guard:
            self._sessions.pop(key, None)

    def base_url(self, key: str) -> str:
        """The ``base_url`` of an OpenAI client for this key's episode."""
        return f"http://{HOST}:{self.port}/v1/{key}"

    def session(self, key: str) -> AgentSession | None:
        with self._guard:
            return self._sessions.get(key)

    def close(self) -> None:
        """Stop serving (calls in flight finish)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def answer(self, path: str, authorization: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) for one ``POST`` (blocks its thread: the HTTP server's, a sync agent's)."""
        try:
            return 200, self._submit(path, authorization, body).result()
        except Exception as err:
            return self._failed(path, err)

    async def answer_async(self, path: str, authorization: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        """``answer`` awaited on another event loop (the agents', ``agent_transport.py``): the call
        runs on its session's loop; cancelling the await cancels the call (its engine request is
        aborted)."""
        try:
            future = self._submit(path, authorization, body)
        except Exception as err:
            return self._failed(path, err)
        try:
            return 200, await asyncio.wrap_future(future)
        except asyncio.CancelledError as err:
            task = asyncio.current_task()
            if future.cancelled() and task is not None and not task.cancelling():  # the episode was stopped
                return self._failed(path, concurrent.futures.CancelledError())
            raise err
        except Exception as err:
            return self._failed(path, err)

    def answer_later(
        self, path: str, authorization: str | None, body: bytes, reply: Callable[[int, dict[str, Any]], None]
    ) -> None:
        """``answer`` without waiting: ``reply(status, payload)`` runs once the call is answered
        (on the session's loop, or now for a call refused before it starts); the agents' process
        (``agent_process.py``) forwards its calls this way."""
        try:
            future = self._submit(path, authorization, body)
        except Exception as err:
            reply(*self._failed(path, err))
            return

        def done(f: concurrent.futures.Future[dict[str, Any]]) -> None:
            if f.cancelled():
                reply(*self._failed(path, concurrent.futures.CancelledError()))
            elif f.exception() is not None:
                reply(*self._failed(path, f.exception()))  # type: ignore[arg-type]
            else:
                reply(200, f.result())

        future.add_done_callback(done)

    def _submit(self, path: str, authorization: str | None, body: bytes) -> concurrent.futures.Future[dict[str, Any]]:
        session = self._route(path, authorization)
        request = _parse(body)
        return asyncio.run_coroutine_threadsafe(session.complete(request), session.loop)

    def _failed(self, path: str, err: Exception) -> tuple[int, dict[str, Any]]:
        self.errors += 1
        if isinstance(err, EndpointError):
            return err.status, _error(str(err), err.code)
        if isinstance(err, concurrent.futures.CancelledError):  # its episode was stopped (straggler, aborted group)
            return 503, _error("the episode was stopped", "episode_stopped")
        log.error("agent endpoint: %s failed", path, exc_info=err)  # a bug behind the call: the agent sees a 500
        return 500, _error(f"internal error: {err!r}", "internal_error")

    def _route(self, path: str, authorization: str | None) -> AgentSession:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if parts[:1] != ["v1"] or "/".join(parts[-2:]) != _ROUTE or len(parts) not in (3, 4):
            raise EndpointError(404, f"no route {path!r}: POST /v1/<key>/chat/completions or /v1/chat/completions")
        key = parts[1] if len(parts) == 4 else _bearer(authorization)
        session = self.session(key) if key else None
        if session is None:
            raise EndpointError(401, "unknown or closed episode key (its episode ended, or it never existed)", "auth")
        return session


def _bearer(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _parse(body: bytes) -> ChatRequest:
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EndpointError(400, f"request body is not JSON: {err}") from err
    if not isinstance(data, dict):
        raise EndpointError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise EndpointError(400, f"{where}: {first['msg']} ({err.error_count()} error(s))") from err


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


def _handler(endpoint: AgentEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: an agent's calls reuse one connection
        disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            endpoint.http_calls += 1
            status, payload = endpoint.answer(self.path, self.headers.get("Authorization"), body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("agent endpoint: " + format, *args)

    return Handler
