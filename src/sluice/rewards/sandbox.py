"""Run untrusted Python source in a child process with CPU, memory, output and wall-time limits,
a private temporary directory, and no network.

How each guarantee is made (no root, no seccomp):

- **no network**: the child runs under ``unshare --user --map-root-user --net`` (``unshare -rn``),
  a fresh network namespace holding only a down loopback device, so every ``connect`` — to
  the internet or to this host's ``127.0.0.1`` — fails. It needs unprivileged user namespaces;
  where the host forbids them the sandbox refuses to run (``SandboxUnavailable``) unless
  ``network="allow"`` was chosen on purpose;
- **CPU time**: ``RLIMIT_CPU`` (the kernel sends SIGXCPU, then SIGKILL a second later);
- **memory**: ``RLIMIT_AS`` (allocations beyond it fail; the launcher turns the resulting
  ``MemoryError`` into exit code ``MEMORY_EXIT``);
- **output**: stdout / stderr go to files capped by ``RLIMIT_FSIZE`` (writes past it fail);
- **wall time**: the child leads its own session and the whole session is SIGKILLed at the
  deadline; ``PR_SET_PDEATHSIG`` kills it too if the process that started it dies;
- **files**: it starts in a fresh ``0700`` temporary directory (its ``HOME`` and ``TMPDIR``),
  removed afterwards, with an empty environment and ``python -I -S`` (no site-packages).

What it does not do: it is not a filesystem jail (the child can read what the user running
sluice can read) and, where sluice runs as root, ``RLIMIT_NPROC`` does not bound forks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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
sys.argv = ["main.py"]
try:
    runpy.run_path("main.py", run_name="__main__")
except MemoryError:
    os._exit({MEMORY_EXIT})
"""


class SandboxUnavailable(RuntimeError):
    """Network isolation was asked for and this host cannot provide it."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    """CPU seconds before the kernel stops the child."""
    memory_mb: int = 512
    """Address-space limit of the child in MiB."""
    wall_s: float = 10.0
    """Wall-clock seconds before the child's whole session is killed."""
    output_kb: int = 1024
    """Largest stdout / stderr file the child may write, in KiB."""
    network: Literal["isolate", "allow"] = "isolate"
    """``isolate``: a private network namespace (no connections at all); ``allow``: none
    (only for trusted code on hosts without unprivileged user namespaces)."""


@dataclass(frozen=True)
class SandboxResult:
    status: SandboxStatus
    returncode: int
    stdout: str
    stderr: str
    wall_s: float


def run_sandboxed(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``source`` as ``main.py`` in a fresh private directory under ``limits``."""
    prefix = _isolation_prefix(limits.network)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-sandbox-"))  # mkdtemp creates it 0700
    try:
        (workdir / "main.py").write_text(source)
        args = [str(limits.cpu_s), str(limits.memory_mb * 1024**2), str(limits.output_kb * 1024)]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}
        started = time.perf_counter()
        with open(workdir / "stdout", "wb") as out, open(workdir / "stderr", "wb") as err:
            child = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-S", "-c", _LAUNCHER, *args],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            timed_out = False
            try:
                child.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_session(child.pid)  # also reaps anything it left running in its session
                child.wait()
        wall = time.perf_counter() - started
        status = "timeout" if timed_out else _status(child.returncode)
        if status == "failed" and _hit_output_cap(workdir, limits.output_kb * 1024):
            status = "output_limit"
        return SandboxResult(status, child.returncode, _tail(workdir / "stdout"), _tail(workdir / "stderr"), wall)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _status(returncode: int) -> SandboxStatus:
    if returncode == 0:
        return "ok"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit"
    if returncode == MEMORY_EXIT:
        return "memory_limit"
    return "failed"


def _hit_output_cap(workdir: Path, cap: int) -> bool:
    return any((workdir / name).stat().st_size >= cap for name in ("stdout", "stderr"))


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the session is already empty
        os.killpg(pid, signal.SIGKILL)


def _tail(path: Path) -> str:
    data = path.read_bytes()
    return data[-OUTPUT_TAIL:].decode("utf-8", errors="replace")


def _isolation_prefix(network: str) -> list[str]:
    if network == "allow":
        return []
    if not network_isolation_available():
        raise SandboxUnavailable(
            "the code sandbox needs unprivileged user namespaces (`unshare -rn true` fails here); "
            "enable them (sysctl kernel.unprivileged_userns_clone=1) or, for trusted code only, set "
            "reward.sandbox_network=allow"
        )
    return ["unshare", "--user", "--map-root-user", "--net"]


@functools.cache
def network_isolation_available() -> bool:
    """Whether ``unshare -rn`` works for this user on this host (probed once per process)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True)
    return probe.returncode == 0
