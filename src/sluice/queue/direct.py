"""Same-node direct calls into the queue's actors over Unix sockets, beside Ray's own calls.

A Ray actor call costs about 0.7 ms here even when it does nothing, and a small ``get`` needs two
in a row (controller, then storage unit), which is most of its latency. Each queue actor therefore
also serves its methods on a Unix socket (``DirectServer``: one thread per connection, the same
thread-safe methods Ray calls); a client on the same node calls them through ``DirectClient``
(one connection per client thread, pickled messages), a round trip of a fraction of Ray's.
Everything else — placement, lifetime, calls across nodes, asyncio callers — stays on Ray.
``fan_out`` runs such blocking calls to several actors concurrently.

It deliberately exposes only the methods named in ``DIRECT_METHODS`` of the served object and
trusts its peers as Ray does (pickle on a socket only processes of this user can open).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, cast

logger = logging.getLogger(__name__)

_counter = itertools.count()
PREFIX = "sluice-q-"


def remove_stale_sockets() -> None:
    """Unlink sockets of processes that no longer exist (a killed actor cannot clean up)."""
    folder = tempfile.gettempdir()
    for name in os.listdir(folder):
        if name.startswith(PREFIX) and name.endswith(".sock"):
            try:
                os.kill(int(name[len(PREFIX) :].split("-")[0]), 0)
            except ProcessLookupError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
            except PermissionError:  # alive, someone else's
                continue


class DirectServer:
    """Serves ``target``'s ``DIRECT_METHODS`` on a fresh Unix socket until the process exits."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self._allowed = frozenset(target.DIRECT_METHODS)
        remove_stale_sockets()
        served = type(target).__name__  # in the name, so a client whose call fails can say who died
        path = os.path.join(tempfile.gettempdir(), f"{PREFIX}{os.getpid()}-{next(_counter)}-{served}.sock")
        self._listener = Listener(path, family="AF_UNIX")
        self.address = path
        threading.Thread(target=self._accept, daemon=True, name="direct-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # listener closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="direct-conn").start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    method, args = conn.recv()
                except (EOFError, OSError):
                    return
                if method not in self._allowed:
                    conn.send((False, AttributeError(f"{method!r} is not served directly")))
                    continue
                try:
                    reply = (True, getattr(self._target, method)(*args))
                except Exception as exc:  # handed back to the caller, who raises it
                    reply = (False, exc)
                conn.send(reply)

    def close(self) -> None:
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)


class _Connections(threading.local):
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.by_address: dict[str, Connection] = {}


_local = _Connections()


def _connection(address: str) -> Connection:
    """This thread's connection to ``address`` (a forked child must not share its parent's sockets)."""
    if _local.pid != os.getpid():
        _local.pid, _local.by_address = os.getpid(), {}
    conn = _local.by_address.get(address)
    if conn is None:
        conn = _local.by_address[address] = Client(address, family="AF_UNIX")
    return conn


class PeerUnreachable(ConnectionError):
    """A direct call's socket failed mid-call: the actor serving ``address`` died (or closed)."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(address, why)  # both in ``args``: the error crosses processes pickled
        self.address, self.why = address, why

    @property
    def served(self) -> str:
        """The class of the object served at ``address`` (``""``: an address not named by
        ``DirectServer``)."""
        name = os.path.basename(self.address)
        found = re.fullmatch(rf"{PREFIX}\d+-\d+-(\w+)\.sock", name)
        return found.group(1) if found else ""

    def __str__(self) -> str:
        return f"the direct socket {self.address} failed ({self.why})"


def call(address: str, method: str, *args: Any) -> Any:
    """``method(*args)`` on the object served at ``address``, from this thread's connection."""
    return call_many([DirectCall(address, method, args)])[0]


@dataclass(frozen=True)
class DirectCall:
    """One direct call, for ``fan_out``: ``method(*args)`` on the object served at ``address``."""

    address: str
    method: str
    args: tuple[Any, ...]

    def __call__(self) -> Any:
        return call(self.address, self.method, *self.args)


def call_many(calls: Sequence[DirectCall]) -> list[Any]:
    """The calls' results, made concurrently from this thread: every request is sent before the
    first reply is read (each server answers on its own thread), so no worker thread is woken."""
    at = ""  # the address being spoken to when a socket fails
    try:
        conns = []
        for c in calls:
            at = c.address
            conns.append(_connection(at))
            conns[-1].send((c.method, c.args))
        replies = []
        for conn, c in zip(conns, calls, strict=True):
            at = c.address
            replies.append(conn.recv())
    except (EOFError, OSError, pickle.PicklingError) as err:  # the connections' state is unknown: drop them
        for c in calls:
            dropped = _local.by_address.pop(c.address, None)
            if dropped is not None:
                dropped.close()
        if isinstance(err, pickle.PicklingError):
            raise
        raise PeerUnreachable(at, f"{type(err).__name__}: {err}") from err
    for ok, value in replies:
        if not ok:
            raise value
    return [value for _, value in replies]


_node: tuple[int, str] | None = None
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def fan_out(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run blocking calls concurrently; results in order. ``DirectCall`` s go out together from
    this thread (``call_many``); any others run on a small thread pool meanwhile."""
    global _pool
    if len(calls) == 1:
        return [calls[0]()]
    direct = [k for k, c in enumerate(calls) if isinstance(c, DirectCall)]
    futures = {}
    if len(direct) < len(calls):
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="queue-fan-out")
        futures = {k: _pool.submit(c) for k, c in enumerate(calls) if not isinstance(c, DirectCall)}
    results = dict(zip(direct, call_many([cast(DirectCall, calls[k]) for k in direct]), strict=True))
    results.update((k, f.result()) for k, f in futures.items())
    return [results[k] for k in range(len(calls))]


def this_node() -> str:
    """This process's Ray node id (cached per process; a pickled client asks again after a fork)."""
    global _node
    if _node is None or _node[0] != os.getpid():
        import ray  # only Ray processes ask

        _node = (os.getpid(), str(ray.get_runtime_context().get_node_id()))
    return _node[1]
