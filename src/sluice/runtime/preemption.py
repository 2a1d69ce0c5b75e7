"""SIGTERM and SIGINT during a run: the first asks it to stop at the next safe point, the second
ends it at once.

``preemptible(tag)`` installs the handlers for the run (only in the main thread: Python delivers
signals there; elsewhere the process's own handlers stay). The first signal only sets
``Preemption.signal``; the loop (``controller/training.py``) reads it after each step (a
checkpoint, then ``RunPreempted``) and before the first one; the watchdog ends a loop that has
not stopped ``run.stall_timeout_s`` after it (``Watchdog.stop_asked``). The second signal SIGKILLs every
process of the run (``processes.kill_own_processes``) and exits with ``128 + signal``, without
unwinding: a hung step cannot hold it.

It decides nothing about checkpoints; it only records and reports the request.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from sluice.runtime.processes import kill_own_processes

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunPreempted(Exception):
    """The run stopped at a safe point on SIGTERM / SIGINT; ``resume=auto`` continues it."""

    def __init__(self, signum: int, version: int, checkpoint: Path | None) -> None:
        self.signum = signum
        self.version = version
        self.checkpoint = checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no new checkpoint (nothing trained since)"
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} at step {version}: {where}; run again with resume=auto to continue")

    @property
    def exit_code(self) -> int:
        """``128 + signal``: 143 for SIGTERM, 130 for SIGINT (the shell's convention)."""
        return 128 + self.signum


@dataclass
class Preemption:
    """The stop request of a run: ``signal`` is the first SIGTERM / SIGINT received, else ``None``."""

    tag: str = ""
    signal: int | None = None
    at: float | None = None
    """When (``time.monotonic``) the first signal came: the watchdog bounds the stop from then."""

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal, self.at = signum, time.monotonic()
            log.warning("%s: stopping after the current step (checkpoint, then exit); send it again to stop now", name)
            return
        log.warning("%s again: stopping now, killing the run's processes", name)
        if self.tag:
            kill_own_processes(self.tag)
        os._exit(128 + signum)


@contextmanager
def preemptible(tag: str) -> Iterator[Preemption]:
    """The run's ``Preemption``, its handlers installed for SIGTERM and SIGINT while inside (and
    the previous ones put back after)."""
    preemption = Preemption(tag)
    if threading.current_thread() is not threading.main_thread():
        yield preemption  # signals reach the main thread only: its handlers stay in charge
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, preemption.handle)
    try:
        yield preemption
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
