"""The sandbox's walls: the bubblewrap command line, the Python runtime it exposes, and cgroups.

``bwrap_argv`` builds a ``bwrap`` invocation that unshares every namespace (user, pid, net, ipc,
uts, mount, cgroup), runs as uid/gid 65534 with every capability dropped, and mounts a
read-only minimal root: the running interpreter's prefix at ``/python`` (its
``site-packages`` hidden under an empty tmpfs, so the standard library only), the shared
libraries that interpreter and its extension modules load (found with ``ldd``), a fresh
``/proc`` of the sandbox's own pid namespace, a minimal ``/dev``, and a size-capped private
tmpfs at ``/tmp`` as the one writable place. Nothing else of the host exists inside: no
project, no venv, no ``/root``, no ``/etc``, no shell, no Ray session directory.

``Cgroup`` puts one sandbox into its own ``pids`` and ``memory`` cgroups (cgroup v1
controllers, or v2 where the root exposes them), kills every member, and reports OOM kills.

This module decides no policy (``sandbox.py`` chooses limits, runs and judges the child) and
does not filter system calls (no seccomp).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

PYTHON_ROOT = "/python"
"""Where the interpreter's prefix appears inside the sandbox."""

SANDBOX_UID = 65534
"""The unprivileged uid / gid (``nobody``) the sandboxed program runs as."""

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class PythonRuntime:
    prefix: Path
    """The interpreter's real installation prefix on the host."""
    executable: str
    """The interpreter's path inside the sandbox (under ``PYTHON_ROOT``)."""
    libraries: tuple[str, ...]
    """Absolute paths of the shared libraries it loads (bound read-only at the same path)."""
    hidden: tuple[str, ...]
    """Directories inside ``PYTHON_ROOT`` covered by an empty tmpfs (``site-packages``)."""


@functools.cache
def python_runtime() -> PythonRuntime:
    """The running interpreter, described once per process."""
    prefix = Path(sys.base_prefix).resolve()
    real = Path(sys.executable).resolve()
    if not real.is_relative_to(prefix):
        raise RuntimeError(f"the interpreter {real} lies outside its prefix {prefix}; the sandbox cannot mount it")
    objects = [real, *prefix.glob("lib/libpython*.so*"), *prefix.glob("lib/python3*/lib-dynload/*.so")]
    listing = subprocess.run(["ldd", *map(str, objects)], capture_output=True, text=True).stdout
    libraries = sorted({p for p in re.findall(r"(/\S+) \(0x", listing) if not Path(p).is_relative_to(prefix)})
    hidden = tuple(
        f"{PYTHON_ROOT}/{p.relative_to(prefix)}" for p in prefix.glob("lib/python3*/site-packages") if p.is_dir()
    )
    return PythonRuntime(prefix, f"{PYTHON_ROOT}/{real.relative_to(prefix)}", tuple(libraries), hidden)


def bwrap_argv(files: dict[str, Path], *, share_net: bool, tmp_bytes: int) -> list[str]:
    """``bwrap`` and its options, up to the command to run inside (append it).

    ``files``: read-only binds, path inside → path on the host."""
    runtime = python_runtime()
    argv = ["bwrap", "--unshare-all", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    argv += ["--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if share_net:
        argv.append("--share-net")
    argv += ["--ro-bind", str(runtime.prefix), PYTHON_ROOT]
    for path in runtime.hidden:
        argv += ["--tmpfs", path, "--remount-ro", path]
    for lib in runtime.libraries:
        argv += ["--ro-bind", str(Path(lib).resolve()), lib]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    for inside, host in files.items():
        argv += ["--ro-bind", str(host), inside]
    argv += ["--chdir", "/tmp", "--clearenv"]
    env = {"PATH": f"{PYTHON_ROOT}/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    env["LD_LIBRARY_PATH"] = f"{PYTHON_ROOT}/lib"
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return [*argv, "--"]


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run a Python program here (``None``: it can), probed once."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (`apt-get install bubblewrap`)"
    try:
        argv = bwrap_argv({}, share_net=False, tmp_bytes=1 << 20)
    except (RuntimeError, OSError) as exc:
        return str(exc)
    probe = subprocess.run([*argv, python_runtime().executable, "-I", "-S", "-c", "pass"], capture_output=True)
    if probe.returncode != 0:
        return f"`bwrap` failed here: {probe.stderr.decode(errors='replace').strip()[:200]}"
    return None


class Cgroup:
    """One sandbox's ``pids`` and ``memory`` cgroups (empty ``dirs`` where none is writable)."""

    def __init__(self, pids_max: int, memory_bytes: int) -> None:
        self.dirs = _create(f"sluice-sandbox-{uuid.uuid4().hex[:12]}", pids_max, memory_bytes)

    def enter_argv(self, argv: list[str]) -> list[str]:
        """``argv`` behind a ``/bin/sh`` that first moves itself into these cgroups."""
        if not self.dirs:
            return argv
        script = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        return ["/bin/sh", "-c", script, "sh", *procs, "--", *argv]

    def kill(self) -> None:
        """SIGKILL every member until none is left (a fork in flight is caught by the next pass)."""
        for _ in range(200):
            pids = {int(p) for d in self.dirs for p in _read(d / "cgroup.procs").split()}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a member for exceeding the memory limit."""
        for d in self.dirs:
            for name in ("memory.oom_control", "memory.events"):
                match = re.search(r"^oom_kill (\d+)", _read(d / name), re.MULTILINE)
                if match and int(match.group(1)) > 0:
                    return True
        return False

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()


def _create(name: str, pids_max: int, memory_bytes: int) -> list[Path]:
    """New cgroups with the limits applied: v1 ``pids`` + ``memory`` dirs, or one v2 dir."""
    v1 = [CGROUP_ROOT / "pids", CGROUP_ROOT / "memory"]
    if all(os.access(d / "cgroup.procs", os.W_OK) for d in v1):
        dirs = [d / name for d in v1]
        limits = {
            dirs[0] / "pids.max": pids_max,
            dirs[1] / "memory.limit_in_bytes": memory_bytes,
            dirs[1] / "memory.memsw.limit_in_bytes": memory_bytes,
        }
    elif {"pids", "memory"} <= set(_read(CGROUP_ROOT / "cgroup.subtree_control").split()):
        dirs = [CGROUP_ROOT / name]
        limits = {dirs[0] / "pids.max": pids_max, dirs[0] / "memory.max": memory_bytes}
        limits[dirs[0] / "memory.swap.max"] = 0
    else:
        return []
    try:
        for d in dirs:
            d.mkdir()
        for path, value in limits.items():
            if path.exists():  # memsw / swap.max exist only with swap accounting
                path.write_text(str(value))
    except OSError:
        for d in dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
        return []
    return dirs


@functools.cache
def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
