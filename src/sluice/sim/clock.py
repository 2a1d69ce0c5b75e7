"""A virtual clock for asyncio: simulated time jumps to the next timer instead of waiting.

``run_virtual(coro)`` runs a coroutine on an event loop whose ``time()`` is virtual: whenever
nothing is ready to run, the loop advances its clock straight to the earliest pending timer
(``asyncio.sleep``, ``wait_for`` timeouts) rather than blocking. A simulation driven by sleeps
(``SimEngine``, a reward latency, a trainer's step time) then finishes as fast as the CPU allows
and is exactly reproducible, while the code under test is the ordinary asyncio code.

Real I/O still works (the real selector is polled before every jump), but work done in other
threads or processes is invisible to the clock: a simulation that waits on a thread pool or a Ray
actor must use the real loop and ``SimEngine``'s ``time_scale`` instead. Not thread-safe.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpSelector(selectors.BaseSelector):
    """Delegates to a real selector; an idle ``select(timeout)`` advances the loop's clock instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._loop = loop
        self._real = selectors.DefaultSelector()

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is None:  # no timer pending: only real I/O can wake the loop
            return self._real.select(None)
        self._loop.advance(timeout)
        return []

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock starts at 0 and moves only by jumping to the next timer."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        super().__init__(_JumpSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh ``VirtualClockLoop`` (like ``asyncio.run``)."""
    loop = VirtualClockLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
