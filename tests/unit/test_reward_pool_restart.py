"""A reward pool worker that dies (SIGKILL while idle or mid-call, or a reward that ends its own
process) is replaced and the call retried once; a second death is a counted failure, not a crash."""

import asyncio
import logging
import os
import signal
import time

from fakes import FaultyReward, length_reward
from sluice.api import RewardFailure
from sluice.rewards import RewardService


def _score(service, texts):
    async def go():
        return await asyncio.gather(*(service(t) for t in texts), return_exceptions=True)

    return asyncio.run(go())


def _warm(service):
    """One call, so the worker has started; its process."""
    assert _score(service, ["ab"]) == [length_reward("ab")]
    (worker,) = service.pool._workers
    return worker.process


def test_a_worker_killed_while_idle_is_replaced_and_the_next_calls_succeed():
    service = RewardService(length_reward, pool_size=1, timeout_s=30.0)
    try:
        old = _warm(service)
        os.kill(old.pid, signal.SIGKILL)
        old.join(timeout=10)
        assert _score(service, ["abc", "abcd", "x"]) == [length_reward(t) for t in ("abc", "abcd", "x")]
        (worker,) = service.pool._workers
        assert worker.process.pid != old.pid and worker.process.is_alive()
    finally:
        service.close()
    stats = service.stats()
    assert stats["reward_worker_restarts"] == 1.0
    assert stats["reward_retries"] == 1.0  # the first call after the kill found it dead
    assert not any(key.startswith("reward_error") for key in stats)


def test_a_worker_killed_mid_call_is_replaced_and_the_call_retried():
    service = RewardService(length_reward, pool_size=1, timeout_s=30.0)
    try:
        old = _warm(service)
        service.fn = FaultyReward("hang", always=True, hang_s=1.0)  # slow enough to be killed in it

        async def go():
            call = asyncio.ensure_future(service("abc"))
            await asyncio.sleep(0.3)
            os.kill(old.pid, signal.SIGKILL)
            return await call

        assert asyncio.run(go()) == 1.0  # the retry on the new worker ran the reward to the end
    finally:
        service.close()
    stats = service.stats()
    assert stats["reward_worker_restarts"] == 1.0
    assert stats["reward_retries"] == 1.0
    assert not any(key.startswith("reward_error") for key in stats)


def test_a_reward_that_kills_its_worker_twice_is_a_counted_failure():
    service = RewardService(FaultyReward("exit", always=True), pool_size=1, timeout_s=30.0, name="dying")
    try:
        (failure,) = _score(service, ["abc"])
        service.fn = length_reward
        assert _score(service, ["abcd"]) == [length_reward("abcd")]  # the pool still serves
    finally:
        service.close()
    assert isinstance(failure, RewardFailure)
    assert failure.reason == "reward_error:dying"
    assert "died twice" in failure.detail and "code 3" in failure.detail
    stats = service.stats()
    assert stats["reward_error:dying"] == 1.0
    assert stats["reward_worker_restarts"] == 2.0 and stats["reward_retries"] == 1.0


def test_a_worker_whose_caller_closed_the_pipe_ends_quietly():
    """A call cancelled mid-way (a straggler episode aborted) closes the caller's end: the worker
    then finds no one to answer and exits, with no traceback in the run's log."""
    import threading
    from multiprocessing import Pipe

    from fakes import FaultyReward
    from sluice.rewards.pool import _serve

    parent, child = Pipe()
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            _serve(child)
        except BaseException as err:  # what the old loop let escape
            failures.append(err)

    worker = threading.Thread(target=serve)
    worker.start()
    assert parent.recv() is True
    parent.send((FaultyReward("hang", always=True, hang_s=0.3), "abc", {}))  # still scoring when...
    parent.close()  # ...the caller gives up
    worker.join(timeout=10)
    assert not worker.is_alive() and not failures


def test_a_stopped_worker_is_named_replaced_and_the_call_retried_within_seconds(caplog):
    """SIGSTOP: the process lives but never answers; the call looks at its state while it waits,
    so it is replaced within about ``STOPPED_POLL_S`` instead of at the reward's 30 s timeout."""
    service = RewardService(length_reward, pool_size=1, timeout_s=30.0)
    try:
        old = _warm(service)
        os.kill(old.pid, signal.SIGSTOP)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="sluice.rewards.pool"):
            assert _score(service, ["abc"]) == [length_reward("abc")]
        assert time.monotonic() - started < 10.0
        (worker,) = service.pool._workers
        assert worker.process.pid != old.pid and worker.process.is_alive()
    finally:
        service.close()
    assert f"reward worker pid {old.pid} is stopped (SIGSTOP): killed and replaced" in caplog.text
    stats = service.stats()
    assert stats["reward_worker_stopped"] == 1.0 and stats["reward_worker_restarts"] == 1.0
    assert stats["reward_retries"] == 1.0 and not any(key.startswith("reward_error") for key in stats)
