"""One owner per run directory: the lock a driver holds on ``<run dir>/run.lock`` for the whole run.

``run_dir_lock(run_dir)`` takes an exclusive ``fcntl.flock`` on the lock file before the run reads
or writes anything else in its run dir, and writes the holder into it: host, pid, the pid's start
time (``driver_id``) and since when (UTC). A second driver on the same run dir (the same run
started twice, a scheduler's retry while the first still runs, a second ``resume=auto``) is
refused with ``RunDirBusy``, one line naming the holder. The lock belongs to the open file, so it
dies with the process that holds it, however it dies (SIGKILL, the OOM killer): a lock file left
with a holder in it is then stale, and the next driver takes it over and says whose it was.
Processes the driver starts do not hold it (Python opens files non-inheritable: ``exec``'d
children such as Ray's daemons and the reaper do not get the descriptor).

``flock`` is per open file description, so two opens in one process exclude each other too (two
``fit`` calls in one process on one run dir). On NFS, Linux maps ``flock`` onto the server's
byte-range locks; a holder on another host is seen through them.

``refuse_if_held`` asks the same question early (``sluice train``, before the model loads) without
taking the lock. It does not stop, wait for or signal the holder; it only refuses or takes over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from sluice.runtime.processes import driver_id

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunDirBusy(Exception):
    """Another live driver holds the run dir; the message names it (host, pid, since when)."""


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[dict[str, object]]:
    """Within: this process owns ``run_dir`` (created if missing); yields the holder record it
    wrote. Raises ``RunDirBusy`` if another open file holds it; a stale holder (its process gone)
    is taken over with one warning. On the way out the record is cleared and the lock released."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(run_dir, fd) from None
        previous = _read(fd)
        if previous:  # written by a holder that never released it: its process is gone
            log.warning("taking over the run dir lock of a driver that is gone (%s; %s)", _describe(previous), path)
        holder: dict[str, object] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "driver": driver_id(os.getpid()) or str(os.getpid()),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _write(fd, json.dumps(holder) + "\n")
        try:
            yield holder
        finally:
            _write(fd, "")  # released in order: no holder left to take over
    finally:
        os.close(fd)  # releases the flock


def refuse_if_held(run_dir: Path) -> None:
    """``RunDirBusy`` now if another driver holds ``run_dir``, before the seconds or minutes a
    model load or an SFT warm start takes (``sluice train`` asks first; ``fit`` takes the lock
    itself). A probe: a shared lock taken and dropped at once, nothing created or written."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(run_dir, fd) from None
    finally:
        os.close(fd)  # drops the probe's shared lock


def _read(fd: int) -> dict[str, object]:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").strip()
    if not text:
        return {}
    try:
        record = json.loads(text)
    except ValueError:
        return {"unreadable": text[:80]}
    return record if isinstance(record, dict) else {"unreadable": text[:80]}


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)


def _busy(run_dir: Path, fd: int) -> RunDirBusy:
    return RunDirBusy(
        f"{run_dir} is in use by another driver ({_describe(_read(fd))}; {run_dir / LOCK_FILE}): wait for it "
        "to end, stop it, or choose another run.name"
    )


def _describe(holder: dict[str, object]) -> str:
    if not holder:
        return "holder not recorded yet"
    if "unreadable" in holder:
        return f"holder record unreadable: {holder['unreadable']!r}"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
