"""The code-execution sandbox's limits: CPU, memory, wall time, output, private files, bad input."""

import ast

import pytest
from harness.sandbox_run import run_sandboxed

from host_probes import cgroups_available
from sluice.rewards.code_exec import extract_code
from sluice.rewards.jail import bwrap_problem
from sluice.rewards.sandbox import SandboxLimits, SandboxUnavailable, network_isolation_available

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap sandbox: {bwrap_problem()}")
needs_cgroups = pytest.mark.skipif(not cgroups_available(), reason="no writable pids / memory cgroups here")


@needs_bwrap
def test_memory_limit_ends_the_program():
    result = run_sandboxed("block = bytearray(1024**3)\nprint('allocated')", SandboxLimits(memory_mb=128))
    assert result.status == "memory_limit" and "allocated" not in result.stdout
    assert run_sandboxed("block = bytearray(8 * 1024**2)", SandboxLimits(memory_mb=128)).status == "ok"


@needs_bwrap
@needs_cgroups
def test_memory_cgroup_bounds_the_whole_process_tree():
    """Each child stays under the per-process ``RLIMIT_AS``; together they pass the cgroup's cap."""
    source = (
        "import os, time\n"
        "for _ in range(6):\n"
        "    if os.fork() == 0:\n"
        "        block = bytearray(60 * 1024**2)\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "while True:\n"
        "    try:\n"
        "        os.wait()\n"
        "    except ChildProcessError:\n"
        "        break\n"
    )
    result = run_sandboxed(source, SandboxLimits(memory_mb=160, wall_s=20))
    assert result.status == "memory_limit" and result.wall_s < 15


@needs_bwrap
def test_cpu_limit_ends_the_program():
    result = run_sandboxed("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert result.status == "cpu_limit" and result.wall_s < 30


@needs_bwrap
def test_output_limit():
    result = run_sandboxed("while True:\n    print('x' * 1000)", SandboxLimits(output_kb=32))
    assert result.status == "output_limit"


@needs_bwrap
def test_private_tmp_empty_environment_and_unprivileged_uid():
    source = (
        "import os\n"
        "print(os.getcwd(), os.getuid(), os.getgid())\n"
        "print(sorted(os.environ))\n"
        "open('scratch', 'w').write('x')\n"
        "print(sorted(os.listdir('/')))\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
    )
    result = run_sandboxed(source)
    where, env, root, caps = result.stdout.splitlines()
    assert result.status == "ok" and where == "/tmp 65534 65534"
    assert env == "['HOME', 'LANG', 'LD_LIBRARY_PATH', 'PATH', 'PWD', 'TMPDIR']"
    assert set(ast.literal_eval(root)) <= {"dev", "lib", "lib64", "proc", "python", "tmp", "usr"}  # no etc, root
    assert int(caps, 16) == 0  # every capability dropped


@needs_bwrap
def test_the_standard_library_only():
    result = run_sandboxed("import json, math, collections, itertools\nimport pytest")
    assert result.status == "failed" and "No module named 'pytest'" in result.stderr


def test_bad_limits_are_one_clear_line():
    with pytest.raises(ValueError, match="sandbox limit cpu_s must be positive, got 0"):
        run_sandboxed("pass", SandboxLimits(cpu_s=0))
    with pytest.raises(ValueError, match="isolation must be 'bwrap' or 'unshare'"):
        run_sandboxed("pass", SandboxLimits(isolation="none"))  # type: ignore[arg-type]


def test_without_bubblewrap_the_sandbox_refuses(monkeypatch):
    monkeypatch.setattr("sluice.rewards.sandbox.bwrap_problem", lambda: "bubblewrap is not installed")
    with pytest.raises(SandboxUnavailable, match=r"needs bubblewrap: bubblewrap is not installed.*isolation='unshare'"):
        run_sandboxed("print(1)")


@pytest.mark.skipif(not network_isolation_available(), reason="unshare -rn does not work here")
def test_the_weaker_mode_runs_when_chosen_by_name():
    result = run_sandboxed("print(6 * 7)", SandboxLimits(isolation="unshare"))
    assert result.status == "ok" and result.stdout.strip() == "42"


def test_extract_code_takes_the_last_block():
    assert extract_code("```py\na = 1\n```\ntext\n```\nb = 2\n```") == "b = 2\n"
