"""CPU seconds a run's processes spend over an interval, by role: what bounds its wall time.

A run is this process and every process descended from it: with a local Ray instance that is
Ray's own daemons and every actor (rollout, trainer, the queue's storage and controller actors),
and in any mode the reward pool's workers. ``CpuMeter()`` reads their user + system CPU time from
``/proc`` when made; ``read()`` returns the seconds each role used since, where a role is a Ray
actor's class (``ray::TrainerWorker`` → ``TrainerWorker``), ``driver`` (this process) or
``other``. ``cpu_total`` divided by the cores is the shortest wall time that work could take on
this machine with every core busy all the time (``sluice bench e2e`` reports it).

Linux only (``/proc``); elsewhere ``read()`` returns ``{}``. Processes that start and end inside
the interval are missed (none do in a training loop). It does not sample or trace anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PROC = Path("/proc")
_RAY_ACTOR = re.compile(r"ray::(\w+)")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of ``pid``; ``None`` if it is gone."""
    try:
        text = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks


def _role(pid: int) -> str:
    if pid == os.getpid():
        return "driver"
    try:
        cmdline = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return "other"
    match = _RAY_ACTOR.search(cmdline)
    return match.group(1) if match and match.group(1) != "IDLE" else "other"


def run_processes() -> dict[int, float]:
    """CPU seconds so far of this process and each of its descendants, by pid."""
    if not PROC.is_dir():
        return {}
    stats = {int(pid): s for pid in os.listdir(PROC) if pid.isdigit() and (s := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in found:
            found[pid] = stats[pid][1]
            todo += children.get(pid, [])
    return found


class CpuMeter:
    """CPU seconds of the run's processes from now until ``read()``, by role, plus the total."""

    def __init__(self) -> None:
        self.start = run_processes()

    def read(self) -> dict[str, float]:
        now = run_processes()
        if not now:
            return {}
        by_role: dict[str, float] = {}
        for pid, seconds in now.items():
            role = _role(pid)
            by_role[role] = by_role.get(role, 0.0) + seconds - self.start.get(pid, 0.0)
        out = {f"cpu_{role}": round(s, 3) for role, s in sorted(by_role.items())}
        return {**out, "cpu_total": round(sum(by_role.values()), 3), "cores": float(os.cpu_count() or 1)}
