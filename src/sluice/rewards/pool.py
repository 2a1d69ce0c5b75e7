"""A pool of reward processes driven from an event loop, with a hard per-call timeout.

Each worker is a ``spawn`` or ``forkserver`` process (never ``fork``: the parent has usually
started torch's thread pools, and a forked copy of their locks can deadlock) that runs one call
at a time and answers over a pipe. The event loop waits on the pipe's file descriptor, so a
slow reward never blocks generation. A call that runs past its timeout, or whose caller is
cancelled, gets its worker killed and replaced: a hung reward cannot keep a pool slot. A worker
found dead (killed from outside, or crashed by the reward: the pipe breaks or closes) is replaced
too, and the call is retried once on the fresh worker; a second crash is the call's failure. A
worker that cannot answer because its process is stopped (SIGSTOP, a debugger: the kernel's
state ``T``), which no heartbeat of the Ray actors would see, is looked for every
``STOPPED_POLL_S`` while a call waits on it: it is named in one warning, counted (``stopped``) and
treated as dead. A reward that runs long in a live process is its timeout's business.

This module moves calls and results; it does not judge them (``service.py`` classifies
failures and counts them).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

StartMethod = Literal["forkserver", "spawn"]
logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
"""How long a new worker may take to start (imports included) before it counts as crashed; a
reward's own timeout starts only once its worker is up."""
STOPPED_POLL_S = 1.0
"""How often a call waiting on its worker looks whether the worker's process is stopped."""


class RewardCallError(Exception):
    """The reward raised (``kind='raised'``) or its worker died (``kind='crashed'``)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def call_reward(fn: Callable[..., Any], response: str, fields: Mapping[str, Any]) -> Any:
    """Call a sync or async reward to completion in this thread (no running event loop here)."""
    value = fn(response, **fields)
    if inspect.isawaitable(value):

        async def _await() -> Any:
            return await value

        value = asyncio.run(_await())
    return value


def _serve(conn: Connection) -> None:
    """A worker's loop: one ``(fn, response, fields)`` in, one ``(ok, value-or-traceback)`` out."""
    conn.send(True)  # started: from now on the caller's timeout measures the reward alone
    while True:
        try:
            fn, response, fields = conn.recv()
        except (EOFError, ConnectionResetError):  # the parent closed the pipe or died: nothing left to do
            return
        try:
            answer = (True, call_reward(fn, response, fields))
        except Exception as exc:  # deliberate: any reward error goes back to be counted
            answer = (False, "".join(traceback.format_exception_only(type(exc), exc)).strip())
        try:
            conn.send(answer)
        except (BrokenPipeError, ConnectionResetError):  # the caller gave up on the call (cancelled)
            return


class _WorkerDied(Exception):
    """A worker's process was found dead (its pipe broke or closed); the call may be retried."""


class _WorkerStopped(Exception):
    """A worker's process is stopped (state ``T``): it will not answer until someone continues it."""


def _stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped by a signal or a tracer (Linux ``/proc``; elsewhere never)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    started: bool = False


class RewardPool:
    """``size`` worker processes; ``await pool.call(fn, response, fields, timeout)``.

    ``fn`` must be picklable by reference (a module-level function or an instance of a
    module-level class). Workers start lazily, on the first call.
    """

    def __init__(self, size: int, start_method: StartMethod = "forkserver") -> None:
        if size < 1:
            raise ValueError(f"reward pool size must be >= 1, got {size}")
        self.size = size
        self._ctx = (
            multiprocessing.get_context("spawn")
            if start_method == "spawn"
            else multiprocessing.get_context("forkserver")
        )
        self._idle: asyncio.Queue[_Worker] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: list[_Worker] = []
        self.replaced = 0
        """Workers killed (timeout, cancellation) or found dead, and started anew."""
        self.retried = 0
        """Calls retried on a fresh worker because their first worker died."""
        self.stopped = 0
        """Workers found stopped (SIGSTOP) under a call, and replaced."""

    async def call(self, fn: Callable[..., Any], response: str, fields: Mapping[str, Any], timeout: float) -> Any:
        """The reward's return value; ``TimeoutError`` past ``timeout`` s; ``RewardCallError``
        when it raised, or when its worker died twice (a dead worker is replaced and the call
        retried once on the new one)."""
        try:
            return await self._call_once(fn, response, fields, timeout)
        except _WorkerDied:
            self.retried += 1
        try:
            return await self._call_once(fn, response, fields, timeout)
        except _WorkerDied as died:
            raise RewardCallError("crashed", f"reward worker died twice: {died}") from died

    async def _call_once(self, fn: Callable[..., Any], response: str, fields: Mapping[str, Any], timeout: float) -> Any:
        """One attempt on an idle worker; ``_WorkerDied`` when its process is found dead."""
        idle = self._idle_workers()
        worker = await idle.get()
        healthy = dead = False
        stopped: _WorkerStopped | None = None
        try:
            dead = not worker.process.is_alive()  # died while idle (killed from outside)
            if not dead:
                await self._wait_started(worker)
                worker.conn.send((fn, response, dict(fields)))
                ok, value = await asyncio.wait_for(self._answer(worker), timeout)
                healthy = True
        except (EOFError, ConnectionError):  # the pipe broke or closed: the process is gone
            dead = True
        except _WorkerStopped as err:  # deliberately: a stopped process is as good as dead, counted
            dead, stopped = True, err
        finally:
            if not healthy:  # timed out, cancelled, dead or unpicklable: never reuse it
                old, worker = worker, self._replace(worker)
            idle.put_nowait(worker)
        if stopped is not None:
            self.stopped += 1
            logger.warning("%s: killed and replaced, its call retried", stopped)
            raise _WorkerDied(str(stopped))
        if dead:
            raise _WorkerDied(f"reward worker exited with code {old.process.exitcode}")
        if not ok:
            raise RewardCallError("raised", value)
        return value

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for worker in self._workers:
            worker.conn.close()
            worker.process.kill()
            worker.process.join(timeout=5)
        self._workers.clear()
        self._idle = self._loop = None

    def _idle_workers(self) -> asyncio.Queue[_Worker]:
        """The idle-worker queue of the running loop (a caller may run one ``asyncio.run`` per
        step: the processes outlive each loop, the queue cannot)."""
        loop = asyncio.get_running_loop()
        if self._idle is None or self._loop is not loop:
            while len(self._workers) < self.size:
                self._start()
            self._idle, self._loop = asyncio.Queue(), loop
            for worker in self._workers:
                self._idle.put_nowait(worker)
        return self._idle

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_serve, args=(child,), daemon=True, name="sluice-reward")
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self._workers.append(worker)
        return worker

    async def _wait_started(self, worker: _Worker) -> None:
        if worker.started:
            return
        try:
            await asyncio.wait_for(self._receive(worker.conn), STARTUP_TIMEOUT_S)
        except TimeoutError as exc:
            raise RewardCallError("crashed", f"reward worker did not start within {STARTUP_TIMEOUT_S} s") from exc
        worker.started = True

    def _replace(self, worker: _Worker) -> _Worker:
        worker.conn.close()
        worker.process.kill()
        worker.process.join(timeout=5)
        self._workers.remove(worker)
        self.replaced += 1
        return self._start()

    async def _answer(self, worker: _Worker) -> Any:
        """The worker's answer to the call sent to it; ``_WorkerStopped`` as soon as a look every
        ``STOPPED_POLL_S`` finds its process stopped."""
        receiving = asyncio.ensure_future(self._receive(worker.conn))
        try:
            while True:
                done, _ = await asyncio.wait([receiving], timeout=STOPPED_POLL_S)
                if done:
                    return receiving.result()
                if _stopped(worker.process.pid):
                    raise _WorkerStopped(f"reward worker pid {worker.process.pid} is stopped (SIGSTOP)")
        finally:
            receiving.cancel()

    @staticmethod
    async def _receive(conn: Connection) -> Any:
        """The next message on ``conn``, waiting on its descriptor without blocking the loop."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = conn.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return conn.recv()  # results are small and written in one go: this does not block
