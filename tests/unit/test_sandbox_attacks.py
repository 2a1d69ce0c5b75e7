"""Attacks on the code sandbox, run as this host's user (root here): every one is blocked.

Each attack runs in the default jail and must fail while the host stays untouched (marker
files, listeners, live processes are checked from outside). Where it is safe, the same attack
runs once more with the jail's relevant wall removed (``isolation="unshare"``, the weaker mode,
or ``network="allow"``) and must succeed there: the control shows the test can see the attack.
"""

import os
import socket
import subprocess
import sysconfig
import threading
import time
import uuid
from pathlib import Path

import pytest
from harness.sandbox_run import run_sandboxed

import sluice
from host_probes import cgroups_available
from sluice.rewards.jail import bwrap_problem
from sluice.rewards.sandbox import SandboxLimits, network_isolation_available

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap sandbox: {bwrap_problem()}")
needs_weak = pytest.mark.skipif(not network_isolation_available(), reason="the weaker unshare mode does not run here")
WEAK = SandboxLimits(isolation="unshare")


class Listener:
    """A socket server of the host that counts the connections (or datagrams) it gets."""

    def __init__(self, family: int, kind: int, address) -> None:
        self.sock = socket.socket(family, kind)
        self.sock.bind(address)
        if kind == socket.SOCK_STREAM:
            self.sock.listen()
        self.sock.settimeout(0.1)
        self.address = self.sock.getsockname()
        self.hits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self.sock.type == socket.SOCK_STREAM:
                    self.sock.accept()[0].close()
                else:
                    self.sock.recvfrom(64)
            except (TimeoutError, OSError):
                continue
            self.hits += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def listeners(tmp_path):
    made = {
        "tcp": Listener(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0)),
        "udp": Listener(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0)),
        "unix": Listener(socket.AF_UNIX, socket.SOCK_STREAM, str(tmp_path / "raylet")),
        "abstract": Listener(socket.AF_UNIX, socket.SOCK_STREAM, f"\0sluice-attack-{uuid.uuid4().hex}"),
    }
    yield made
    for listener in made.values():
        listener.close()


def _reach(kind: str, address) -> str:
    family = {"tcp": "AF_INET", "udp": "AF_INET"}.get(kind, "AF_UNIX")
    sock_type = "SOCK_DGRAM" if kind == "udp" else "SOCK_STREAM"
    address = tuple(address) if kind in ("tcp", "udp") else address
    send = "s.sendto(b'x', address)" if kind == "udp" else "s.connect(address)"
    return f"import socket\naddress = {address!r}\ns = socket.socket(socket.{family}, socket.{sock_type})\n{send}\n"


@pytest.mark.parametrize("kind", ["tcp", "udp", "unix", "abstract"])
def test_sockets_to_host_listeners_are_blocked(listeners, kind):
    listener = listeners[kind]
    result = run_sandboxed(_reach(kind, listener.address) + "import time\ntime.sleep(0.3)")
    assert result.status == ("ok" if kind == "udp" else "failed"), result.stderr  # a datagram goes to its own lo
    assert listener.hits == 0
    if kind in ("tcp", "udp", "abstract"):  # control: with the host's network these get through
        assert run_sandboxed(_reach(kind, listener.address), SandboxLimits(network="allow")).status == "ok"
        _wait_for(lambda: listener.hits == 1)


@needs_weak
def test_unix_path_sockets_and_ray_files_do_not_exist_inside(listeners):
    """Ray's raylet / plasma sockets are path sockets like this one; ``~/.ray`` is under ``/root``."""
    probe = "import os\nprint([p for p in ('/tmp/ray', '/root/.ray', '/root') if os.path.exists(p)])"
    assert run_sandboxed(probe).stdout.strip() == "[]"
    unix = listeners["unix"]
    assert run_sandboxed(_reach("unix", unix.address), WEAK).status == "ok"  # control: reachable without the jail
    _wait_for(lambda: unix.hits == 1)


FILES = ["/etc/passwd", "/etc/shadow", str(Path(sluice.__file__).resolve().parents[2] / "pyproject.toml"), "/root"]
READ = "import os\nfor path in {files!r}:\n    try:\n        print(os.listdir(path) if os.path.isdir(path) else open(path).read()[:20])\n    except OSError as exc:\n        print('blocked', type(exc).__name__)\n"  # noqa: E501


@needs_weak
def test_host_files_cannot_be_read():
    result = run_sandboxed(READ.format(files=FILES))
    assert result.stdout.splitlines() == ["blocked FileNotFoundError"] * 4, result.stdout
    assert "root:" in run_sandboxed(READ.format(files=FILES[:1]), WEAK).stdout  # control


@needs_weak
def test_writes_outside_the_private_tmp_do_not_land(tmp_path):
    token = uuid.uuid4().hex
    targets = [
        tmp_path / "marker",
        Path(sysconfig.get_paths()["purelib"]) / f"sluice_attack_{token}.pth",
        Path(sluice.__file__).parent / f"_attack_{token}.py",
        Path("/tmp") / f"sluice_attack_{token}",
    ]
    write = "for path in {paths!r}:\n    try:\n        open(path, 'w').write('import os')\n    except OSError as exc:\n        print('blocked', type(exc).__name__)\n"  # noqa: E501
    result = run_sandboxed(write.format(paths=[str(p) for p in targets[:3]]))
    assert len(result.stdout.splitlines()) == 3 and not any(p.exists() for p in targets[:3])
    run_sandboxed(write.format(paths=[str(targets[3])]))  # its own /tmp: lands there, not on the host
    assert not targets[3].exists()
    assert run_sandboxed(write.format(paths=[str(targets[0])]), WEAK).status == "ok"  # control
    assert targets[0].exists()


@needs_weak
def test_signals_cannot_reach_host_processes():
    victims = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        kill = (
            "import os, signal\n"
            "for pid in [os.getppid(), {victim}] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    if pid != os.getpid():\n"
            "        try:\n            os.kill(pid, signal.SIGKILL)\n"
            "        except OSError:\n            pass\n"
        )
        run_sandboxed(kill.format(victim=victims[0].pid))
        assert victims[0].poll() is None  # the victim lives, and so does this test process
        run_sandboxed(f"import os\nos.kill({victims[1].pid}, 9)", WEAK)  # control: by PID, without the jail
        assert victims[1].wait(timeout=5) == -9
    finally:
        for victim in victims:
            victim.kill()
            victim.wait()


def test_parent_proc_environ_mem_and_environment_secrets_stay_hidden(monkeypatch):
    secret = f"sluice-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SLUICE_TEST_SECRET", secret)
    spy = (
        "import os, re\nfound = [os.environ.get('SLUICE_TEST_SECRET')]\n"
        f"for pid in ({os.getpid()}, os.getppid(), 1):\n"
        "    try:\n"
        "        with open(f'/proc/{pid}/environ', 'rb') as f:\n"
        "            found += re.findall(rb'SLUICE_TEST_SECRET=([^\\0]*)', f.read())\n"
        "        with open(f'/proc/{pid}/mem', 'rb') as f:\n"
        "            found.append(f.read(1))\n"
        "    except OSError as exc:\n        found.append(type(exc).__name__)\n"
        "print(found)\n"
    )
    result = run_sandboxed(spy)
    assert result.status == "ok" and secret not in result.stdout, result.stdout
    assert result.stdout.startswith("[None, 'FileNotFoundError'")  # no such variable, no such host pid


@pytest.mark.parametrize(
    "source",
    [
        "block = bytearray(8 * 1024**3)\nprint('allocated')",
        "import mmap\nblock = mmap.mmap(-1, 8 * 1024**3)\nblock[::4096] = b'x' * (8 * 1024**3 // 4096)\n"
        "print('allocated')",
    ],
    ids=["bytearray", "mmap"],
)
def test_eight_gigabytes_cannot_be_allocated(source):
    result = run_sandboxed(source)
    assert result.status in ("memory_limit", "failed") and "allocated" not in result.stdout


@pytest.mark.skipif(not cgroups_available(), reason="no writable pids cgroup here")
def test_a_200_fork_bomb_is_capped_and_dies():
    token = f"sluice-bomb-{uuid.uuid4().hex}"
    bomb = (
        "import subprocess, sys\nstarted = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        f"        subprocess.Popen([sys.executable, '-S', '-c', 'import time; time.sleep(30)', '{token}'])\n"
        "        started += 1\n"
        "    except OSError:\n        break\n"
        "print(started, flush=True)\nimport time\ntime.sleep(30)\n"
    )
    result = run_sandboxed(bomb, SandboxLimits(processes=32, wall_s=3))
    assert result.status == "timeout" and int(result.stdout.split()[0]) < 32
    assert_gone(token)


@needs_weak
def test_a_setsid_grandchild_does_not_outlive_the_limit():
    token = f"sluice-escape-{uuid.uuid4().hex}"
    escape = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)', '{token}'],"
        " start_new_session=True)\n"
        "time.sleep(60)\n"
    )
    assert run_sandboxed(escape, SandboxLimits(wall_s=1.5)).status == "timeout"
    assert_gone(token)
    run_sandboxed(escape, SandboxLimits(wall_s=1.5, isolation="unshare"))  # control: it escapes the weak mode
    escaped = _pids_with(token)
    for pid in escaped:
        os.kill(pid, 9)
    assert escaped


@needs_weak
def test_ctypes_system_and_a_shell_find_nothing_to_run(tmp_path):
    marker = tmp_path / "shell-ran"
    shell = (
        "import ctypes, subprocess\n"
        f"print(ctypes.CDLL(None).system(b'touch {marker}'))\n"
        f"try:\n    subprocess.run('touch {marker}', shell=True)\n"
        "except OSError as exc:\n    print('blocked', type(exc).__name__)\n"
        "import os\nprint(os.path.exists('/bin/sh'), os.path.exists('/usr/bin'))\n"
    )
    result = run_sandboxed(shell)
    assert not marker.exists() and result.stdout.split()[-2:] == ["False", "False"], result.stdout
    run_sandboxed(shell, WEAK)  # control: the weak mode runs the host's shell
    assert marker.exists()


def test_wall_timeout_kills_the_program_and_its_children():
    token = f"sluice-wall-{os.getpid()}"
    source = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{token}'])\n"
        "time.sleep(60)"
    )
    result = run_sandboxed(source, SandboxLimits(wall_s=1.0))
    assert result.status == "timeout" and result.wall_s < 10
    assert_gone(token)


def _wait_for(condition) -> None:
    for _ in range(40):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError("the control attack did not reach the host")


def assert_gone(token: str) -> None:
    """No process of this host has ``token`` in its command line (zombies aside)."""
    for _ in range(50):
        alive = _pids_with(token)
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes {alive} with {token!r} outlived the sandbox")


def _pids_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(") ", 1)[1][0]
        except OSError:
            continue
        if token.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found
