"""The run tag every process of a run carries, and the sweeps that make sure none outlives it.

``tag_run(run_dir)`` puts two variables into the driver's environment before the run starts
anything: ``SLUICE_RUN_TAG`` (a hash of the run dir's absolute path: the same for a resume of
that dir, so a resumed run finds what its crashed predecessor left) and ``SLUICE_RUN_DRIVER``
(the driver's pid and start time: which driver a process belongs to, unambiguous across pid
reuse). Every child inherits them: Ray's local instance and its workers, the reward pool's
forkserver and workers; Ray actors get them again through their ``runtime_env``
(``ray_pipeline._runtime``), for a cluster that was not started by this driver.

``sweep_leftovers`` (at start-up) stops the processes with the run's tag whose driver is gone,
SIGTERM then SIGKILL after a grace; ``stop_own_processes`` (at the run's end, on every path)
stops the ones of this driver that are still there, but for multiprocessing's forkserver and
resource tracker, which belong to the process (a later run in it reuses them) and exit with it.
``start_reaper`` starts a process that stops them all if the driver dies without doing it: the
tagged ones, and every process it saw descend from the driver (a process that rewrites its title,
as Ray's agents do with ``setproctitle``, may overwrite the environment ``/proc`` shows, tag
included; its ancestry still names the run).
The sweeps never touch the current driver nor a process whose driver is alive and not this one
(another live run in the same run dir: a warning, not a kill).

Linux only: processes are found by reading ``/proc/<pid>/environ`` (what a process was started
with), which needs no library and sees every process of this user. Elsewhere both sweeps find
nothing. It does not start, supervise or restart anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TAG_VAR = "SLUICE_RUN_TAG"
DRIVER_VAR = "SLUICE_RUN_DRIVER"
GRACE_S = 5.0
"""How long a SIGTERMed process has to exit before it gets SIGKILL."""
SETTLE_S = 5.0
"""How long the run's processes have to exit on their own at its end before they are stopped."""
PROC = Path("/proc")
_DONE = b"done"
LINEAGE_S = 1.0
"""How often the reaper notes which processes descend from the driver."""
_MP_HELPER = " -c from multiprocessing."
_WANDB_SERVICE = "wandb-core"
"""In the name of multiprocessing's forkserver and resource tracker (and of the forkserver's children)."""


@dataclass(frozen=True)
class TaggedProcess:
    pid: int
    driver: str
    """``SLUICE_RUN_DRIVER`` of the process: ``<pid>-<start time>`` of the driver that started it."""
    name: str


def run_tag(run_dir: Path) -> str:
    """The tag of every run in ``run_dir`` (fresh or resumed): a hash of its absolute path."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def driver_id(pid: int) -> str | None:
    """``<pid>-<start time in clock ticks>`` of a running process, ``None`` if it is gone."""
    stat = _stat(pid)
    return None if stat is None or stat[0] in "ZX" else f"{pid}-{stat[1]}"


@contextlib.contextmanager
def tagged_run(run_dir: Path) -> Iterator[str]:
    """Within: this process's environment names the run (``tag_run``), a crashed predecessor's
    leftovers swept first. On the way out, on any path: a Ray instance started inside is shut
    down, this driver's processes that are still running are stopped, and the environment is put
    back (a later run in this process is another run)."""
    saved = {var: os.environ.get(var) for var in (TAG_VAR, DRIVER_VAR)}
    tag = tag_run(run_dir)
    ray_was_up = _ray_up()
    reaper = None
    try:
        sweep_leftovers(tag)
        reaper = start_reaper(tag)
        yield tag
    finally:
        if not ray_was_up and _ray_up():  # the local instance this run started (its daemons, workers)
            sys.modules["ray"].shutdown()
        if reaper is not None:
            stop_reaper(reaper)
        stop_own_processes(tag, keep_ray=ray_was_up)
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def tag_run(run_dir: Path) -> str:
    """Set ``SLUICE_RUN_TAG`` and ``SLUICE_RUN_DRIVER`` in this process's environment (children
    inherit them); returns the tag."""
    tag = run_tag(run_dir)
    os.environ[TAG_VAR] = tag
    os.environ[DRIVER_VAR] = driver_id(os.getpid()) or str(os.getpid())
    return tag


def start_reaper(tag: str) -> subprocess.Popen[bytes] | None:
    """A small process (this file run as a script, standard library only) that stops the run's
    processes if this driver dies without doing it (SIGKILL): it waits for the end of its stdin,
    which only this driver holds. In a session of its own, so a kill of the driver's process
    group spares it. ``None`` where there is no ``/proc`` to find the processes in."""
    if not PROC.is_dir():
        return None
    argv = [sys.executable, "-I", __file__, tag, os.environ[DRIVER_VAR]]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)


def stop_reaper(reaper: subprocess.Popen[bytes]) -> None:
    """Tell the reaper the run ended in order (it exits without sweeping) and wait for it."""
    assert reaper.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # it may be gone already
        reaper.stdin.write(_DONE)
        reaper.stdin.close()
    reaper.wait()


def reap(tag: str, driver: str) -> int:
    """The reaper's work: until the end of its stdin, note every ``LINEAGE_S`` the processes that
    descend from the driver and started after the run did (what the driver ran before is not the
    run's); at the end, if the driver is gone (no ``done``), stop what it left: its tagged
    processes and the descendants it was seen with (still the same processes), though they may
    have lost their parent (Ray's daemons die with the driver) or their tag."""
    driver_pid, born = int(driver.partition("-")[0]), _started(os.getpid())
    said, seen = b"", dict[int, str]()
    while True:
        if select.select([0], [], [], LINEAGE_S)[0]:
            chunk = os.read(0, 64)
            if chunk:
                said += chunk
                continue
            break
        seen.update(descendants(driver_pid, since=born))
    if said == _DONE:
        return 0
    left = {p.pid for p in tagged_processes(tag) if p.driver == driver}
    left |= {pid for pid, identity in seen.items() if _same_process(pid, identity)}
    left.discard(os.getpid())
    terminate(sorted(left))
    return 0


def descendants(root: int, since: int = 0) -> dict[int, str]:
    """``pid -> driver_id`` of every running process below ``root`` (children, theirs, ...)
    started at or after clock tick ``since``; one read of ``/proc/<pid>/stat`` per process."""
    children: dict[int, list[int]] = {}
    stats = {}
    for entry in os.listdir(PROC):
        stat = _stat(int(entry)) if entry.isdigit() else None
        if stat is not None:
            stats[int(entry)] = stat
            children.setdefault(stat[2], []).append(int(entry))
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        state, start, _ = stats[pid]
        if state not in "ZX" and int(start) >= since:
            found[pid] = f"{pid}-{start}"
        todo.extend(children.get(pid, []))
    return found


def tagged_processes(tag: str) -> list[TaggedProcess]:
    """Every running process (but this one) started with ``SLUICE_RUN_TAG=tag``."""
    if not PROC.is_dir():
        return []
    found = []
    wanted = f"{TAG_VAR}={tag}".encode()
    for entry in os.listdir(PROC):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:  # deliberately: a process may end while we read, or belong to another user
            env = (PROC / entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted not in env:
            continue
        driver = next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(f"{DRIVER_VAR}=".encode())), "")
        found.append(TaggedProcess(int(entry), driver, _name(int(entry))))
    return found


def sweep_leftovers(tag: str, grace: float = GRACE_S) -> int:
    """Stop the processes with ``tag`` left by a driver that is gone (a crashed run of this run
    dir); one line with the count. Processes of a live driver are left alone."""
    me = driver_id(os.getpid())
    live: dict[str, bool] = {}
    orphans, others = [], set()
    for proc in tagged_processes(tag):
        if proc.driver == me:
            continue
        if proc.driver not in live:
            live[proc.driver] = _driver_alive(proc.driver)
        if live[proc.driver]:
            others.add(proc.driver)
        else:
            orphans.append(proc)
    if others:
        log.warning("run tag %s: processes of another live driver (%s) left running", tag, ", ".join(sorted(others)))
    if orphans:
        names = sorted({p.name for p in orphans})
        log.warning(
            "stopping %d processes left by a previous run of this run dir (tag %s): %s",
            len(orphans), tag, ", ".join(names),
        )  # fmt: skip
        terminate([p.pid for p in orphans], grace)
    return len(orphans)


def stop_own_processes(tag: str, settle: float | None = None, grace: float = GRACE_S, keep_ray: bool = False) -> int:
    """Stop this driver's processes with ``tag`` still running ``settle`` (default ``SETTLE_S``)
    seconds after the run closed its workers (Ray's workers exit on their own once its daemons
    are gone); one line says how many there were. ``keep_ray``: the run joined a Ray instance it
    did not start, whose pooled workers and daemons are the instance's, not the run's (its actors
    were killed when it closed its workers)."""
    me = driver_id(os.getpid())
    deadline = time.monotonic() + (SETTLE_S if settle is None else settle)

    def own(proc: TaggedProcess) -> bool:
        return proc.driver == me and not _process_helper(proc) and not (keep_ray and _of_ray(proc.pid))

    while (mine := [p for p in tagged_processes(tag) if own(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if mine:
        log.warning(
            "stopping %d processes of this run still running at its end: %s",
            len(mine), ", ".join(sorted({p.name for p in mine})),
        )  # fmt: skip
        terminate([p.pid for p in mine], grace)
    return len(mine)


def _of_ray(pid: int) -> bool:
    """A Ray worker (``ray::…``) or one of Ray's daemons (a program inside the ``ray`` package)."""
    try:
        cmdline = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return cmdline.startswith(b"ray::") or b"/ray/" in cmdline


def _process_helper(proc: TaggedProcess) -> bool:
    """multiprocessing's forkserver or resource tracker of this process (the reward pool's), or
    wandb's service (the wandb tracker's): they belong to the process, not the run (a later run
    in it reuses them) and exit when it does."""
    helper = _MP_HELPER in proc.name or proc.name.startswith(_WANDB_SERVICE)
    return helper and _parent(proc.pid) == os.getpid()


def kill_own_processes(tag: str) -> None:
    """SIGKILL this driver's processes with ``tag`` now (an exit that cannot wait)."""
    me = driver_id(os.getpid())
    for proc in tagged_processes(tag):
        if proc.driver == me:
            _signal(proc.pid, signal.SIGKILL)


def terminate(pids: list[int], grace: float = GRACE_S) -> None:
    """SIGTERM each of ``pids``; SIGKILL the ones still running after ``grace`` seconds."""
    started = {pid: driver_id(pid) for pid in pids}
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (running := [p for p in pids if _same_process(p, started[p])]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in running:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while any(_same_process(p, started[p]) for p in running) and time.monotonic() < deadline:
        time.sleep(0.05)


def _ray_up() -> bool:
    """Whether this process is connected to Ray (without importing it: a local run never does)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _same_process(pid: int, identity: str | None) -> bool:
    """Whether ``pid`` is still the process it was (running, not a zombie, not a reused pid)."""
    return identity is not None and driver_id(pid) == identity


def _driver_alive(driver: str) -> bool:
    pid, _, _ = driver.partition("-")
    return pid.isdigit() and driver_id(int(pid)) == driver


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # it may have exited since the scan
        os.kill(pid, sig)


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(state letter, start time in clock ticks, parent pid) from ``/proc/<pid>/stat``; ``None``
    if it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    return fields[0], fields[19], int(fields[1])


def _started(pid: int) -> int:
    """The start time of ``pid`` in clock ticks since boot (-1 if it is gone)."""
    stat = _stat(pid)
    return -1 if stat is None else int(stat[1])


def _parent(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[2]


def _name(pid: int) -> str:
    """The program and its first argument that is not an option (a Python script), by file name."""
    try:
        argv = [a.decode(errors="replace") for a in (PROC / str(pid) / "cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return "?"
    if "-c" in argv[1:-1]:  # python -c CODE (multiprocessing's forkserver, resource tracker)
        return f"{Path(argv[0]).name} -c {argv[argv.index('-c') + 1]}"[:60]
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    return " ".join(Path(a).name for a in [*argv[:1], script] if a)[:60] or "?"


if __name__ == "__main__":  # the reaper: python processes.py TAG DRIVER (started by start_reaper)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(reap(sys.argv[1], sys.argv[2]))
