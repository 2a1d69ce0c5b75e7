"""The reward service: scores responses off the event loop, with a timeout, and counts failures.

``RewardService(fn, ...)`` is itself a ``RewardFn`` (an async callable), so workflows call it
like any reward. It runs ``fn`` in a ``RewardPool`` of processes (``pool_size >= 1``) or, with
``pool_size = 0``, in a daemon thread of this process per call (for rewards that cannot be
pickled; a hung one then leaks its thread, but the call still times out, and the thread is never
joined: not by ``asyncio.run``'s end, which joins the loop's default executor forever, nor at the
interpreter's exit, so a run stopped by its failure budget still exits).

A call that raises, runs past ``timeout_s``, or returns something that is not a finite number (a
``bool`` counts as 1 / 0: ``return pred == gt``) raises ``RewardFailure`` whose ``reason``
(``reward_error:NAME``, ``reward_timeout:NAME``, ``reward_invalid:NAME``) becomes the discard
reason of the sample's group; every failure is also counted here per function. A pool worker that
dies, or is found stopped (SIGSTOP), is replaced and its call retried once
(``reward_worker_restarts``, ``reward_retries``, ``reward_worker_stopped``); a second death is a
``reward_error``. With ``latency_s`` each call first waits as a remote service would (no CPU; a
benchmark's workload). The service does not decide what happens to the group (the rollout worker
does: ``rollout.filters.reward_failure``), nor when failures are too many (the
controller's budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import numbers
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from sluice.api import RewardFailure
from sluice.rewards.by_value import shippable
from sluice.rewards.pool import RewardCallError, RewardPool, StartMethod, call_reward

log = logging.getLogger(__name__)


def reward_name(fn: Callable[..., Any]) -> str:
    """The name failures are counted under: a function's ``__name__``, else its class's."""
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardService:
    """``await service(response, **fields) -> float``; failures raise ``RewardFailure``."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        pool_size: int = 2,
        timeout_s: float = 30.0,
        start_method: StartMethod = "forkserver",
        name: str | None = None,
        latency_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.__name__ = name or reward_name(fn)
        self.fn = shippable(fn, self.__name__) if pool_size > 0 else fn  # a closure goes by value
        self.timeout_s = timeout_s
        self.pool = RewardPool(pool_size, start_method) if pool_size > 0 else None
        self.calls: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        """Failures per ``reward_<kind>:<name>`` reason."""
        self.seconds = 0.0
        self.latency_s = latency_s
        self._latency_rng = random.Random(seed)

    async def __call__(self, response: str, **fields: Any) -> float:
        started = time.perf_counter()
        self.calls[self.__name__] += 1
        try:
            if self.latency_s > 0:  # a remote service's wait (``reward.latency_s``), no CPU
                await asyncio.sleep(max(0.0, self._latency_rng.gauss(self.latency_s, self.latency_s)))
            value = await self._run(response, fields)
        finally:
            self.seconds += time.perf_counter() - started
        if isinstance(value, bool) or type(value).__name__ == "bool_":  # ``pred == gt``: Python's or numpy's
            return float(bool(value))
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise self._failed("invalid", f"returned {value!r}, not a finite number or a bool")
        return float(value)

    async def _run(self, response: str, fields: Mapping[str, Any]) -> Any:
        try:
            if self.pool is not None:
                return await self.pool.call(self.fn, response, fields, self.timeout_s)
            return await asyncio.wait_for(_in_daemon_thread(call_reward, self.fn, response, fields), self.timeout_s)
        except TimeoutError as exc:
            raise self._failed("timeout", f"no result within {self.timeout_s} s") from exc
        except RewardCallError as exc:
            raise self._failed("error", exc.detail) from exc
        except Exception as exc:  # pool_size = 0: the reward's own exception, counted like a pool's
            if self.pool is not None:
                raise
            raise self._failed("error", f"{type(exc).__name__}: {exc}") from exc

    def _failed(self, kind: str, detail: str) -> RewardFailure:
        failure = RewardFailure(kind, self.__name__, detail)
        self.failures[failure.reason] += 1
        if self.failures[failure.reason] == 1:  # the rest are counted (stats), not logged one by one
            log.warning("%s (further %s failures are counted in metrics, not logged)", failure, failure.reason)
        else:
            log.debug("%s", failure)
        return failure

    def stats(self) -> dict[str, float]:
        """``reward_calls``, ``reward_seconds``, ``reward_worker_restarts`` (pool processes killed at
        a timeout or found dead, and started anew), ``reward_retries`` (calls run again because
        their worker died), ``reward_worker_stopped`` (workers found stopped under a call) and one
        ``reward_<kind>:<name>`` count per failure."""
        failures = {reason: float(n) for reason, n in self.failures.items()}
        pool = {
            "reward_worker_restarts": float(self.pool.replaced if self.pool else 0),
            "reward_retries": float(self.pool.retried if self.pool else 0),
            "reward_worker_stopped": float(self.pool.stopped if self.pool else 0),
        }
        return {"reward_calls": float(sum(self.calls.values())), "reward_seconds": self.seconds, **pool, **failures}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` in a daemon thread of its own; its result or exception on the returned future.
    A caller that stops waiting (a timeout) abandons the thread: nothing ever joins it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()  # as asyncio.to_thread: the caller's context variables

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # the caller timed out and cancelled it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def run() -> None:
        value, error = None, None
        try:
            value = context.run(fn, *args)
        except BaseException as exc:  # handed to the awaiting caller, as asyncio.to_thread does
            error = exc
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for it
                loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="sluice-reward", daemon=True).start()
    return future
