"""Agents in a process of their own: their Python (the ``openai`` client's included) off the engine's GIL.

``AgentProcess`` starts one child (a fresh interpreter, never a ``fork``: torch has run in the
parent; not ``multiprocessing``'s spawn either, which re-imports the parent's ``__main__``) that
imports the agent by its path and runs episodes as tasks on its own event loop (a synchronous
agent in the loop's thread pool). The parent sends ``(episode, base_url, key, row)`` down a pipe;
the child builds an ``openai`` client on that ``base_url`` whose calls go down the same pipe
(``("call", id, path, authorization, body)``: plain ``chat.completions`` calls directly,
``agent_client.py``, others through its transport); the parent answers it through
``AgentEndpoint.answer_later`` (the routing, validation, session and errors of the HTTP server)
and sends ``("answer", id, status, payload)`` back. The child sends back each episode's return
value or the ``repr`` of what it raised. ``cancel`` stops an episode's task (its timeout). Why:
in the rollout worker's process the agents' CPU (the ``openai`` client builds and parses every
call) held the GIL that the engine's decode loop needs between torch ops, so each engine step
waited on agent code; over loopback HTTP the server's threads cost more than they saved
(measured: ``docs/agentic.md``). The child imports nothing of sluice beyond this module, its
transports and the agent's own imports; the parent's ``sys.path`` is its ``PYTHONPATH`` so the same
agent path resolves. Not here: the endpoint and recording (``agent_endpoint.py``, ``agent_session.py``),
timeouts and failure counting (``agent_runner.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any


class AgentProcessError(RuntimeError):
    """What an agent raised in the child (its ``repr``), or the child's death."""


class AgentProcess:
    """One child process playing agent episodes (see the module docstring)."""

    def __init__(self, agent: str, endpoint: Any, threads: int = 64) -> None:
        ours, theirs = socket.socketpair()
        start = f"_child_main({theirs.fileno()}, {agent!r}, {threads})"
        command = f"from sluice.rollout.agent_process import _child_main; {start}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._process = subprocess.Popen([sys.executable, "-c", command], pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self.endpoint = endpoint
        self._ids = itertools.count()
        self._futures: dict[int, concurrent.futures.Future[Any]] = {}
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="agent-process-writer", daemon=True)
        self._writer.start()
        self._loop: asyncio.AbstractEventLoop | None = None

    def submit(self, base_url: str, key: str, row: dict[str, Any]) -> concurrent.futures.Future[Any]:
        """Play one episode in the child (called on the engine's event loop, which reads the
        child's messages from then on); the future holds the agent's return value (or raises
        ``AgentProcessError``). Cancelling the future cancels the episode's task."""
        self._read_on(asyncio.get_running_loop())
        episode = next(self._ids)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._futures[episode] = future
        future.add_done_callback(lambda f: self._send(("cancel", episode)) if f.cancelled() else None)
        self._send(("play", episode, base_url, key, row))
        return future

    def close(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running() and not _running_on(loop):
            loop.call_soon_threadsafe(self._stop_reading)
        else:
            self._stop_reading()
        self._send(("stop",))
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=5)
        self._conn.close()

    def _send(self, message: tuple[Any, ...]) -> None:
        """Queue ``message`` for the child: answers are sent from the engine's loop, which must not
        wait on a pipe the child is slow to drain."""
        self._outbox.put(message)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone: its episodes were failed by the reader
                return
            if message[0] == "stop":
                return

    def _read_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the child's messages on ``loop`` (the engine's, where its calls run): no reader
        thread, so a call costs no hand-off between threads for the GIL (``_readable``). A new
        loop (the previous one closed: a runner used by successive ``asyncio.run`` calls) takes over."""
        if self._loop is not loop:
            self._stop_reading()
            self._loop = loop
            loop.add_reader(self._conn.fileno(), self._readable)

    def _readable(self) -> None:
        """Answer the child's calls and resolve its episodes, every message that is waiting; when
        the child dies, fail the rest."""
        try:
            while self._conn.poll():
                message = self._conn.recv()
                if message[0] == "call":
                    call = message[1]
                    self.endpoint.answer_later(*message[2:], lambda s, p, c=call: self._send(("answer", c, s, p)))
                    continue
                _, episode, ok, value = message
                future = self._futures.pop(episode, None)
                if future is None or future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(AgentProcessError(value))
        except (EOFError, OSError):
            self._stop_reading()
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(AgentProcessError("the agents' process exited"))

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        self._loop = None


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _child_main(fd: int, agent: str, threads: int) -> None:
    """The child: load the agent, then play what the parent sends until ``stop``."""
    import openai

    from sluice.rollout.agent_client import direct_chat
    from sluice.rollout.agent_loader import load_agent
    from sluice.rollout.agent_transport import pipe_transports

    conn = Connection(fd)
    fn = load_agent(agent)
    loop = asyncio.new_event_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="agent"))
    tasks: dict[int, asyncio.Future[Any]] = {}
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    calls, (async_transport, sync_transport) = pipe_transports(openai, loop, send)
    http: dict[str, Any] = {"async": openai.DefaultAsyncHttpxClient(transport=async_transport)}
    http["sync"] = openai.DefaultHttpxClient(transport=sync_transport)

    async def play(episode: int, base_url: str, key: str, row: dict[str, Any]) -> None:
        try:
            if inspect.iscoroutinefunction(fn):
                client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=http["async"])
                result = await fn(direct_chat(openai, client, calls.call_async), row)
            else:

                def run() -> Any:
                    sync = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=http["sync"])
                    return fn(direct_chat(openai, sync, answer=calls.call), row)

                result = await loop.run_in_executor(None, run)
            send(("done", episode, True, result))
        except asyncio.CancelledError:
            pass
        except Exception as err:  # the agent's own failure: the parent fails its episode
            send(("done", episode, False, repr(err)))
        finally:
            tasks.pop(episode, None)

    def handle(message: tuple[Any, ...]) -> None:
        if message[0] == "play":
            tasks[message[1]] = loop.create_task(play(*message[1:]))
        elif message[0] == "cancel" and message[1] in tasks:
            tasks[message[1]].cancel()
        elif message[0] == "stop":
            loop.stop()

    def read() -> None:
        try:
            while True:
                message = conn.recv()
                if message[0] == "answer":
                    calls.answer(*message[1:])
                    continue
                loop.call_soon_threadsafe(handle, message)
                if message[0] == "stop":
                    return
        except (EOFError, OSError):  # the parent is gone
            loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read, daemon=True).start()
    loop.run_forever()
