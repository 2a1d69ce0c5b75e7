"""The watchdog without Ray: a silent worker stops the run naming it, a silent replaceable one is
replaced, a dead one stops it at once, a loop that stops moving stops it (unless paused or a
worker is silent), and ``supervised`` cancels the loop it stops."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.runtime.supervision import Heartbeat, Watchdog, WorkerDied, WorkerStalled, supervised

TIMEOUT = 0.4


def _watchdog(*args: object) -> Watchdog:
    """A watchdog whose workers have no longer for their first answer than for any other."""
    return Watchdog(*args, first_answer_s=0.0)  # type: ignore[arg-type]


class Worker:
    """A pingable fake: answers, hangs (a stopped process) or raises (a dead one)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = "alive"
        self.replaced = 0

    async def ping(self) -> int:
        if self.state == "dead":
            raise ConnectionError(f"{self.name} is gone")
        while self.state == "stopped":
            await asyncio.sleep(0.01)
        return 1

    async def replace(self) -> None:
        self.replaced += 1
        self.state = "alive"

    def beat(self, replaceable: bool = False) -> Heartbeat:
        def dead(err: BaseException) -> str | None:
            return str(err) if isinstance(err, ConnectionError) else None

        return Heartbeat(self.name, self.ping, dead, self.replace if replaceable else None)


async def _loop(moves: list[int], seconds: float) -> str:
    """A loop that moves every 50 ms for ``seconds``."""
    for _ in range(int(seconds / 0.05)):
        moves[0] += 1
        await asyncio.sleep(0.05)
    return "done"


def test_a_loop_that_finishes_with_answering_workers_is_left_alone():
    moves, worker = [0], Worker("trainer")
    watchdog = _watchdog(TIMEOUT, [worker.beat()], lambda: moves[0])
    assert asyncio.run(supervised(_loop(moves, 1.0), watchdog)) == "done"


def test_a_stopped_worker_stops_the_run_naming_it():
    moves, worker = [0], Worker("trainer")
    worker.state = "stopped"
    with pytest.raises(WorkerStalled, match=r"^the trainer sent no heartbeat for \d+ s .*resume=auto"):
        asyncio.run(supervised(_loop(moves, 5.0), _watchdog(TIMEOUT, [worker.beat()], lambda: moves[0])))


def test_a_dead_worker_stops_the_run_at_once():
    moves, worker = [0], Worker("queue storage unit")
    worker.state = "dead"
    with pytest.raises(WorkerDied, match=r"the queue storage unit died \(queue storage unit is gone\)"):
        asyncio.run(supervised(_loop(moves, 5.0), _watchdog(TIMEOUT, [worker.beat()], lambda: moves[0])))


def test_a_stopped_replaceable_worker_is_replaced_and_the_loop_goes_on():
    moves, rollout = [0], Worker("rollout worker")
    rollout.state = "stopped"
    watchdog = _watchdog(TIMEOUT, [rollout.beat(replaceable=True)], lambda: moves[0])
    assert asyncio.run(supervised(_loop(moves, 1.5), watchdog)) == "done"
    assert rollout.replaced == 1 and watchdog.replaced == {"rollout worker": 1}


def test_a_loop_that_stops_moving_stops_the_run_unless_paused():
    still = [0]
    worker = Worker("trainer")

    async def hung() -> None:
        await asyncio.sleep(5.0)

    with pytest.raises(WorkerStalled, match=r"^the training loop made no progress"):
        asyncio.run(supervised(hung(), _watchdog(TIMEOUT, [worker.beat()], lambda: still[0])))

    async def paused() -> str:
        watchdog = _watchdog(TIMEOUT, [worker.beat()], lambda: still[0])

        async def evaluating() -> str:
            with watchdog.paused():
                await asyncio.sleep(1.0)
            return "evaluated"

        return await supervised(evaluating(), watchdog)

    assert asyncio.run(paused()) == "evaluated"


def test_a_silent_worker_is_named_instead_of_the_loop_it_holds_up():
    still, worker = [0], Worker("trainer (rank 1)")
    worker.state = "stopped"

    async def waiting_on_it() -> None:
        await asyncio.sleep(5.0)

    with pytest.raises(WorkerStalled, match=r"^the trainer \(rank 1\) sent no heartbeat"):
        asyncio.run(supervised(waiting_on_it(), _watchdog(TIMEOUT, [worker.beat()], lambda: still[0])))


def test_a_worker_that_computes_is_progress_though_the_loop_waits_on_it():
    """A long train step: the loop waits on the trainer, whose heartbeats report CPU seconds rising
    as fast as the wall clock (a deadlocked trainer's would stay flat: the previous test)."""
    still, cpu = [0], [0.0]

    async def computing() -> float:
        cpu[0] += 0.1  # pinged every 0.1 s: one busy core
        return cpu[0]

    trainer = Heartbeat("trainer", computing, lambda err: None)

    async def one_long_step() -> str:
        await asyncio.sleep(1.2)
        return "stepped"

    assert asyncio.run(supervised(one_long_step(), _watchdog(TIMEOUT, [trainer], lambda: still[0]))) == "stepped"


@pytest.mark.parametrize(
    ("served", "role"),
    [("StorageActor", "queue storage unit"), ("ControllerActor", "queue controller"), ("Other", "queue actor")],
)
def test_a_reset_direct_queue_connection_names_the_actor_serving_it(served, role):
    """A queue actor's death can reach the driver as a worker's failed direct call to it (the
    same-node socket transport), inside a Ray task error, not as a Ray actor error: it still gets
    its one line, naming the actor the socket belonged to (its class is in the socket's name)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="sq") as short:  # AF_UNIX paths end at 108 bytes: not tmp_path
        _reset_connection_is_named(Path(short), served, role)


def _reset_connection_is_named(tmp_path, served, role):
    import pickle
    import threading
    from multiprocessing.connection import Listener

    from ray.exceptions import RayTaskError

    from sluice.queue.direct import PREFIX, PeerUnreachable, call
    from sluice.runtime.ray_supervision import explain_death

    address = str(tmp_path / f"{PREFIX}123-0-{served}.sock")
    with Listener(address, family="AF_UNIX") as listener:  # an actor that dies as the call arrives
        dying = threading.Thread(target=lambda: listener.accept().close())
        dying.start()
        with pytest.raises(PeerUnreachable) as failed:
            call(address, "get", 1)
        dying.join()
    crossed = pickle.loads(pickle.dumps(failed.value))  # as it leaves the worker's process
    assert crossed.address == address and crossed.served == served
    remote = RayTaskError("step", "traceback", crossed).as_instanceof_cause()  # as the driver meets it
    wrapped = RuntimeError("a step failed")
    wrapped.__cause__ = remote
    stopped = explain_death(wrapped, {})
    assert stopped is not None and str(stopped).startswith(f"the {role} died")
    with pytest.raises(PeerUnreachable) as gone:  # an actor whose socket is already gone
        call(str(tmp_path / f"{PREFIX}124-0-{served}.sock"), "get", 1)
    assert str(explain_death(gone.value, {})).startswith(f"the {role} died")
    assert explain_death(RuntimeError("something else"), {}) is None
    assert explain_death(ConnectionResetError("some other socket"), {}) is None


def test_a_loop_asked_to_stop_that_keeps_going_is_stopped_after_the_timeout():
    """SIGTERM / SIGINT asked the loop to stop; it keeps moving (a step that never ends while its
    workers compute): the watchdog ends it ``timeout_s`` after the request, naming why."""
    moves, worker = [0], Worker("trainer")
    asked: list[float | None] = [None]

    async def run() -> str:
        watchdog = _watchdog(TIMEOUT, [worker.beat()], lambda: moves[0], lambda: asked[0])
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, lambda: asked.__setitem__(0, time.monotonic()))
        return await supervised(_loop(moves, 5.0), watchdog)

    started = time.monotonic()
    with pytest.raises(WorkerStalled, match=r"^the training loop did not stop when asked to for \d+ s"):
        asyncio.run(run())
    assert time.monotonic() - started < 0.3 + TIMEOUT + 3 * min(5.0, TIMEOUT / 4) + 0.5


def test_a_worker_has_longer_for_its_first_answer_then_the_timeout():
    """A Ray actor answers nothing until its constructor returns: silent at first for 3 timeouts
    (within ``first_answer_s``) it is not a stall; once it answered, silence is judged by the
    timeout."""
    moves, worker = [0], Worker("'reference' task worker")
    worker.state = "stopped"

    async def run() -> str:
        loop = asyncio.get_running_loop()
        loop.call_later(3 * TIMEOUT, lambda: setattr(worker, "state", "alive"))  # constructed
        loop.call_later(3 * TIMEOUT + 0.5, lambda: setattr(worker, "state", "stopped"))  # then stopped
        watchdog = Watchdog(TIMEOUT, [worker.beat()], lambda: moves[0], first_answer_s=10 * TIMEOUT)
        return await supervised(_loop(moves, 10.0), watchdog)

    started = time.monotonic()
    with pytest.raises(WorkerStalled, match=r"^the 'reference' task worker sent no heartbeat"):
        asyncio.run(run())
    assert 3 * TIMEOUT + 0.5 <= time.monotonic() - started < 3 * TIMEOUT + 0.5 + 4 * TIMEOUT


def test_the_workers_found_silent_are_those_that_answered_then_went_quiet():
    """``Answers`` (a pipeline's teardown waits for none it names), asked when the watchdog has
    named a stall: the worker that answered and then was stopped is silent; one that answers,
    or one still starting (never answered), is not; without a watchdog (timeout 0) none is."""
    from sluice.runtime.supervision import Answers

    answers, workers = Answers(), [Worker("trainer"), Worker("queue controller"), Worker("reference")]
    workers[2].state = "stopped"  # stopped while starting: never answered (it has FIRST_ANSWER_S)
    beats = [Heartbeat(w.name, answers.timed(w.name, w.ping), w.beat().dead) for w in workers]
    moves = [0]

    async def run() -> None:
        async def stop_later() -> None:
            await asyncio.sleep(0.3)
            workers[1].state = "stopped"

        stopping = asyncio.ensure_future(stop_later())
        await supervised(_loop(moves, 5.0), Watchdog(TIMEOUT, beats, lambda: moves[0]))
        await stopping

    with pytest.raises(WorkerStalled, match=r"^the queue controller sent no heartbeat"):
        asyncio.run(run())
    assert answers.silent(TIMEOUT) == {"queue controller"}
    assert answers.silent(0.0) == set()
