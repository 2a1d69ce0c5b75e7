"""The code-execution sandbox: no network, CPU / memory / wall / output limits, private directory."""

import socket
import threading

import pytest

from sluice.rewards import CodeExecReward
from sluice.rewards.code_exec import extract_code
from sluice.rewards.sandbox import SandboxLimits, network_isolation_available, run_sandboxed

needs_netns = pytest.mark.skipif(
    not network_isolation_available(), reason="this host forbids unprivileged user namespaces (unshare -rn)"
)


@pytest.fixture
def loopback_server():
    """A TCP server on 127.0.0.1 that counts the connections it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted.append(conn)
            conn.sendall(b"hello")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


CONNECT = """
import socket
with socket.create_connection(("127.0.0.1", {port}), timeout=3) as s:
    print(s.recv(5).decode())
"""


@needs_netns
def test_sandboxed_code_cannot_reach_a_loopback_server(loopback_server):
    port, accepted = loopback_server
    control = run_sandboxed(CONNECT.format(port=port), SandboxLimits(network="allow"))
    assert control.status == "ok" and control.stdout.strip() == "hello"  # the server is reachable...
    assert len(accepted) == 1
    isolated = run_sandboxed(CONNECT.format(port=port))
    assert isolated.status == "failed"  # ...but not from inside the sandbox
    assert "Network is unreachable" in isolated.stderr or "Connection refused" in isolated.stderr
    assert len(accepted) == 1


def test_memory_limit_kills_the_child():
    result = run_sandboxed("block = bytearray(1024**3)\nprint('allocated')", SandboxLimits(memory_mb=128))
    assert result.status == "memory_limit" and "allocated" not in result.stdout
    assert run_sandboxed("block = bytearray(8 * 1024**2)", SandboxLimits(memory_mb=128)).status == "ok"


def test_cpu_limit_kills_the_child():
    result = run_sandboxed("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert result.status == "cpu_limit"
    assert result.wall_s < 30


def test_wall_timeout_kills_the_child_and_its_session():
    source = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)"
    )
    result = run_sandboxed(source, SandboxLimits(wall_s=1.0))
    assert result.status == "timeout" and result.wall_s < 10
    grandchild = int(result.stdout.split()[0])
    _assert_gone(grandchild)


def _assert_gone(pid):
    """``pid`` is dead (or a zombie awaiting its reaper)."""
    import os
    import time

    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError(f"process {pid} outlived the sandbox's deadline")


def test_output_limit():
    result = run_sandboxed("while True:\n    print('x' * 1000)", SandboxLimits(output_kb=32))
    assert result.status == "output_limit"


def test_private_directory_and_empty_environment():
    result = run_sandboxed("import os\nprint(os.getcwd())\nprint(sorted(os.environ))\nopen('scratch', 'w').write('x')")
    cwd, env = result.stdout.splitlines()
    assert result.status == "ok" and "sluice-sandbox-" in cwd
    assert env == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    import os

    assert not os.path.exists(cwd)  # removed afterwards


def test_code_exec_reward_runs_the_last_code_block_against_the_tests():
    reward = CodeExecReward(SandboxLimits(cpu_s=1, wall_s=5))
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    good = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    looping = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert reward(good, tests=tests) == 1.0
    assert reward(wrong, tests=tests) == 0.0
    assert reward(looping, tests=tests) == 0.0
    assert reward("def add(a, b): return a + b", tests=tests) == 1.0  # no fence: the whole response


def test_code_exec_runs_from_the_reward_pool():
    import asyncio

    from sluice.config import RewardConfig
    from sluice.rewards import build_reward_service

    service = build_reward_service(RewardConfig(name="code_exec", pool_size=1), default=lambda r: 0.0)
    try:
        value = asyncio.run(service("```python\nprint(1)\n```", tests="assert True"))
    finally:
        service.close()
    assert value == 1.0 and service.stats()["reward_calls"] == 1


def test_extract_code_takes_the_last_block():
    assert extract_code("```py\na = 1\n```\ntext\n```\nb = 2\n```") == "b = 2\n"
