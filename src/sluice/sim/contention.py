"""``SharedDevice``: generation and training on one device, for the pipeline simulator.

When the trainer shares its device with the replicas (this 2-core machine: one decoding thread,
one training thread, one memory system), it computes more slowly while a replica is generating
than while every replica is idle. The replicas report when they start and stop working
(decoding, prefilling, loading weights); the trainer spends its work through ``spend``, which
advances at the contended rate while any replica works and ``alone_speedup`` times faster
while none does, switching rate at the moment the replicas' state changes.

It does not slow the replicas down in turn (the engine's calibrated iteration time already holds
its share of the machine; see docs/planner.md) and it knows no costs itself: the caller passes
the work in contended seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class SharedDevice:
    """Counts the working replicas and wakes a ``spend`` in progress when the count reaches or
    leaves zero (see the module docstring)."""

    def __init__(self) -> None:
        self.working = 0
        """Replicas decoding, prefilling or loading weights right now."""
        self._changed = asyncio.Event()

    def start(self) -> None:
        """A replica begins working."""
        self.working += 1
        if self.working == 1:
            self._notify()

    def stop(self) -> None:
        """A replica stops working."""
        self.working -= 1
        if self.working == 0:
            self._notify()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """A replica works for the duration of the block."""
        self.start()
        try:
            yield
        finally:
            self.stop()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def spend(self, work_s: float, alone_speedup: float) -> None:
        """Take ``work_s`` seconds of work as timed beside working replicas: progress is 1 per
        second while a replica works and ``alone_speedup`` per second while none does."""
        if alone_speedup == 1.0:  # a device of its own: the work is the time
            await asyncio.sleep(work_s)
            return
        loop = asyncio.get_running_loop()
        left = work_s
        while left > 0:
            rate = 1.0 if self.working else alone_speedup
            changed = self._changed
            start = loop.time()
            try:
                await asyncio.wait_for(changed.wait(), left / rate)
            except TimeoutError:
                return  # the work is done before the replicas' state changed
            left -= (loop.time() - start) * rate
