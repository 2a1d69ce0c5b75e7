"""Waiting for requests known to be on their way before a decode step: fewer, fuller steps.

An agent's episode (``rollout/agent_runner.py``) sends its next call a round trip after its last
answer: the agent's own code (the ``openai`` client builds and parses every call) runs in another
process first. On a machine short of CPU those round trips spread the episodes' turns over many
small decode batches, and each step costs about the same whatever its batch (the tiny calculator
agent measured 1,459 engine steps against its ``Env``'s 646 for the same tokens). ``ArrivalHold``
lets the engine's driver wait before a step while the calls it was told to expect outnumber its
batch (running rows plus waiting requests), waking at each arrival, for at most ``hold`` times
its recent step time, so a step is delayed by at most about one step and never waits for calls
that do not come. Deliberately not here: which requests are expected (the agent sessions count
them, ``agent_session.ExpectedCalls``) and anything that changes what a step computes: a held
step samples exactly the tokens an unheld one would (sampling is per sample, ``sampling.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class ArrivalHold:
    """The wait before an engine step (see the module docstring)."""

    def __init__(self, expected: Callable[[], float], hold: float) -> None:
        if hold < 0:
            raise ValueError(f"hold must be >= 0, got {hold}")
        self.expected, self.hold = expected, hold
        self.step_s = 0.0
        """Moving average of the engine's step time (seconds), the unit of ``hold``."""
        self.holds = 0
        """Steps that waited."""
        self.held_s = 0.0
        """Seconds waited, all steps together."""

    def stepped(self, seconds: float) -> None:
        """The engine took ``seconds`` for a step (its wait not included)."""
        self.step_s = seconds if not self.step_s else 0.9 * self.step_s + 0.1 * seconds

    async def wait(self, batch: Callable[[], int], arrived: asyncio.Event) -> None:
        """Return once the expected requests no longer outnumber ``batch()``, or after ``hold``
        step times; ``arrived`` is set by the engine when a request comes in."""
        start = time.perf_counter()
        deadline = start + self.hold * self.step_s
        waited = False
        while self.expected() > batch():
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            arrived.clear()
            waited = True
            try:
                await asyncio.wait_for(arrived.wait(), left)
            except TimeoutError:
                break
        if waited:
            self.holds += 1
            self.held_s += time.perf_counter() - start
