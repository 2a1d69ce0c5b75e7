"""Run untrusted Python in a bubblewrap jail with CPU, memory, process, output and wall-time limits.

One sandboxed program is one ``bwrap`` process tree (walls in ``jail.py``):

- **namespaces**: user, pid, net, ipc, uts, mount and cgroup are all unshared; the program runs
  as uid 65534 with no capabilities, sees only its own processes (a fresh ``/proc``), no network
  device but a down loopback (no TCP / UDP anywhere, no abstract Unix sockets of the host), and
  a read-only root holding the Python runtime alone (no project, venv, ``/root``, ``/etc``,
  shell or Ray socket: no Unix socket path of the host exists inside);
- **files**: a private tmpfs ``/tmp`` (capped at ``memory_mb``) is its one writable place;
- **processes**: a ``pids`` cgroup caps their number at ``processes`` (``RLIMIT_NPROC`` does
  not bind root); a ``memory`` cgroup caps the whole tree at ``memory_mb``, and
  ``RLIMIT_AS`` each process (an allocation past it raises ``MemoryError``);
- **CPU / output**: ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL) and ``RLIMIT_FSIZE`` on the
  stdout / stderr files;
- **wall time**: at the deadline the ``bwrap`` session is SIGKILLed; the pid namespace's init
  dies with it and the kernel kills every process left in the namespace, ``setsid``
  escapees included; then every member of the cgroups is SIGKILLed.

Where bubblewrap cannot run, ``python_argv`` raises ``SandboxUnavailable`` (``require_sandbox``
checks up front) unless the weaker mode was chosen by name, ``isolation="unshare"``: a private
network namespace only (``unshare -rn``), no filesystem jail, no process bound, signals reach the
host's processes.

What it does not do: it filters no system calls (no seccomp), so it relies on the kernel's
namespace code; it does not score programs (``code_exec.py`` does).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from sluice.rewards.jail import Cgroup, bwrap_argv, bwrap_problem, python_runtime

MEMORY_EXIT = 86
"""Exit code of a child whose allocation hit the memory limit."""

OUTPUT_TAIL = 4096
"""Characters of stdout / stderr kept in a ``SandboxResult``."""

SandboxStatus = Literal["ok", "failed", "timeout", "cpu_limit", "memory_limit", "output_limit"]

_LAUNCHER = f"""
import ctypes, os, resource, runpy, signal, sys
cpu, memory, output = (int(a) for a in sys.argv[1:4])
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the process that started us
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
sys.argv = sys.argv[4:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except MemoryError:
    os._exit({MEMORY_EXIT})
"""


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot be provided on this host."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    """CPU seconds before the kernel stops a process of the sandbox."""
    memory_mb: int = 512
    """Memory of the whole sandbox (cgroup), and address space of each process, in MiB."""
    wall_s: float = 10.0
    """Wall-clock seconds before the whole sandbox is killed."""
    output_kb: int = 1024
    """Largest stdout / stderr file the program may write, in KiB."""
    network: Literal["isolate", "allow"] = "isolate"
    """``isolate``: a private network namespace (no connections at all); ``allow``: the host's
    network (trusted code only; it also exposes the host's abstract Unix sockets)."""
    processes: int = 64
    """Most processes (threads included) alive at once in the sandbox (pids cgroup)."""
    isolation: Literal["bwrap", "unshare"] = "bwrap"
    """``bwrap``: the jail described above, or ``SandboxUnavailable``; ``unshare``: the weaker
    network-only mode, chosen by name where bubblewrap cannot run."""


@dataclass(frozen=True)
class SandboxResult:
    status: SandboxStatus
    returncode: int
    stdout: str
    stderr: str
    wall_s: float


class Jailed:
    """One started sandbox: ``wait(deadline)``, then ``stop()`` (which kills what is left)."""

    def __init__(self, argv: list[str], limits: SandboxLimits, out: IO[bytes], err: IO[bytes], fds: tuple[int, ...]):
        self.cgroup = Cgroup(limits.processes, limits.memory_mb << 20) if limits.isolation == "bwrap" else None
        argv = self.cgroup.enter_argv(argv) if self.cgroup else argv
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        self.process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=fds, start_new_session=True
        )
        self.oom_killed = False

    def wait(self, deadline: float) -> bool:
        """Whether the sandbox was still running at ``deadline`` (a ``time.monotonic()``)."""
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return True
        return False

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # bwrap; the pid namespace dies with it
        self.process.wait()
        if self.cgroup:
            self.oom_killed = self.cgroup.oom_killed()
            self.cgroup.remove()

    def status(self, timed_out: bool, out_path: Path, err_path: Path, output_cap: int) -> SandboxStatus:
        """How the sandbox ended (call after ``stop``)."""
        code = self.process.returncode
        if timed_out:
            return "timeout"
        if code == MEMORY_EXIT or self.oom_killed:
            return "memory_limit"
        if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):  # bwrap's init reports a signal as 128 + n
            return "cpu_limit"
        if code != 0 and any(p.stat().st_size >= output_cap for p in (out_path, err_path)):
            return "output_limit"
        return "ok" if code == 0 else "failed"


def python_argv(script: str, args: list[str], limits: SandboxLimits, files: dict[str, Path], cwd: Path) -> list[str]:
    """The command that runs ``script`` (a path inside the sandbox) with ``args`` under ``limits``.

    ``files`` (inside path → host path) are mounted read-only; in ``unshare`` mode, where there
    is no mount namespace, they are copied into ``cwd`` and the paths must lie under ``/tmp``."""
    rlimits = [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.output_kb << 10)]
    if limits.isolation == "unshare":
        for inside, host in files.items():
            shutil.copy(host, cwd / Path(inside).relative_to("/tmp"))
        script = str(cwd / Path(script).relative_to("/tmp"))
        prefix = [] if limits.network == "allow" else _unshare_prefix()
        return [*prefix, "env", "-C", str(cwd), f"HOME={cwd}", f"TMPDIR={cwd}", sys.executable, "-I", "-S", "-c",
                _LAUNCHER, *rlimits, script, *args]  # fmt: skip
    _require_bwrap()
    jail = bwrap_argv(files, share_net=limits.network == "allow", tmp_bytes=limits.memory_mb << 20)
    return [*jail, python_runtime().executable, "-I", "-S", "-c", _LAUNCHER, *rlimits, script, *args]


def check_limits(limits: SandboxLimits) -> None:
    """One clear line for limits no sandbox can honour."""
    if limits.isolation not in ("bwrap", "unshare"):
        raise ValueError(f"sandbox isolation must be 'bwrap' or 'unshare', got {limits.isolation!r}")
    if limits.network not in ("isolate", "allow"):
        raise ValueError(f"sandbox network must be 'isolate' or 'allow', got {limits.network!r}")
    for name in ("cpu_s", "memory_mb", "wall_s", "output_kb", "processes"):
        if not getattr(limits, name) > 0:
            raise ValueError(f"sandbox limit {name} must be positive, got {getattr(limits, name)!r}")


def require_sandbox(limits: SandboxLimits) -> None:
    """Raise now, with one clear line, where ``limits`` cannot be honoured on this host: bad
    limits (``ValueError``), or an isolation that cannot run here (``SandboxUnavailable``)."""
    check_limits(limits)
    if limits.isolation == "bwrap":
        _require_bwrap()
    elif limits.network == "isolate":
        _unshare_prefix()


def _require_bwrap() -> None:
    problem = bwrap_problem()
    if problem is not None:
        raise SandboxUnavailable(
            f"the code sandbox needs bubblewrap: {problem}; for trusted code only, choose the weaker "
            "mode by name (SandboxLimits(isolation='unshare'); config: reward.sandbox_isolation=unshare)"
        )


def output_tail(path: Path) -> str:
    data = path.read_bytes()
    return data[-OUTPUT_TAIL:].decode("utf-8", errors="replace")


def _unshare_prefix() -> list[str]:
    if not network_isolation_available():
        raise SandboxUnavailable(
            "the weaker 'unshare' sandbox needs unprivileged user namespaces (`unshare -rn true` fails "
            "here); for trusted code only, set network='allow' (config: reward.sandbox_network=allow)"
        )
    return ["unshare", "--user", "--map-root-user", "--net"]


@functools.cache
def network_isolation_available() -> bool:
    """Whether ``unshare -rn`` works for this user on this host (probed once per process)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True)
    return probe.returncode == 0
