"""The Ray side of supervision: worker actor classes with a heartbeat, waiting for a restarted
actor, and a dead actor's one line.

``supervised(cls)`` makes a worker class a Ray actor class whose ``heartbeat`` (the process's CPU
seconds) runs in a concurrency group of its own, so ``runtime/supervision.py``'s watchdog is
answered while the actor trains or generates; the worker classes themselves stay Ray-free.
``explain_death`` turns a Ray actor error (found among an exception's causes) into
``WorkerDied``: which worker, its pid and why, in one line.

Not here: what to do about a death (``RayPipeline``, ``Controller``) or when to call it one
(``Watchdog``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from sluice.api.health import HEALTH
from sluice.queue.direct import PeerUnreachable
from sluice.runtime.supervision import WorkerDied

ROLLOUT_RESTARTS = 3
"""How many times Ray restarts a dead rollout worker before its death stops the run."""
RESTART_TIMEOUT_S = 180.0
"""How long a restarted rollout worker may take to start (a Ray worker, its engine, its model)."""
ACTOR_ROLES = {
    "RolloutWorker": "rollout worker",
    "TrainerWorker": "trainer",
    "NodeTaskWorker": "queue-task worker",
    "StorageActor": "queue storage unit",
    "ControllerActor": "queue controller",
    "_Registry": "weight registry",
}
"""What a dead actor's class is, in the one line that stops the run."""
T = TypeVar("T")


def supervised(cls: type) -> Any:
    """``cls`` as a Ray actor class with a ``heartbeat`` (its CPU seconds) for ``Watchdog``,
    answered in a concurrency group of its own (beside the work), ``node_ip`` and ``node_id``."""
    import ray

    def heartbeat(self: object) -> float:
        return time.process_time()  # CPU seconds: the watchdog tells a working process from a hung one

    def node_ip(self: object) -> str:
        """This actor's node's IP address as Ray knows it (rendezvous addresses use it)."""
        return str(ray.util.get_node_ip_address())

    def node_id(self: object) -> str:
        """The id of the Ray node this actor runs on (where the placement put it)."""
        return str(ray.get_runtime_context().get_node_id())

    members = {"heartbeat": heartbeat, "node_ip": node_ip, "node_id": node_id, "__module__": cls.__module__}
    with_heartbeat = type(cls.__name__, (cls,), members)
    return ray.remote(concurrency_groups={HEALTH: 1})(with_heartbeat)  # type: ignore[call-overload]


async def when_alive(call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """``call()``'s answer once the actor answers: while Ray restarts it, calls fail fast."""
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except RayActorError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


def death_detail(err: BaseException) -> str:
    """An actor error in a few words: its pid and why it died (Ray's message is a page)."""
    text = str(err)
    pid, why = re.search(r"\bpid: (\d+)", text), re.search(r"The actor is dead because ([^.]*)", text)
    if pid or why:
        return ", ".join(part for part in (pid and f"pid {pid.group(1)}", why and why.group(1)) if part)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def explain_death(err: BaseException, names: Mapping[str, str]) -> WorkerDied | None:
    """``WorkerDied`` for the Ray actor error among ``err``'s causes (``None``: there is none);
    ``names``: actor id (hex) → worker name, else the actor's class says it (``ACTOR_ROLES``)."""
    from ray.exceptions import RayActorError

    found: BaseException | None = err
    while found is not None and not isinstance(found, RayActorError):
        if isinstance(found, PeerUnreachable):  # a worker's direct call: its task error, not a death
            role = ACTOR_ROLES.get(found.served, "queue actor")
            return WorkerDied(role, "a worker's direct connection to it was reset")
        found = found.__cause__ or found.__context__
    if found is None:
        return None
    named = names.get(getattr(found, "actor_id", None) or "")
    cls = re.search(r"class_name: (\w+)", str(found))
    worker = named or (ACTOR_ROLES.get(cls.group(1), cls.group(1)) if cls else "worker process")
    return WorkerDied(worker, death_detail(found))
