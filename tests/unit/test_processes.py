"""The run tag, the sweeps and the reaper (``runtime/processes.py``) and the stop request
(``runtime/preemption.py``) on real processes: plain ``python -c`` sleepers carrying a tag."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sluice.runtime import processes
from sluice.runtime.preemption import RunPreempted, preemptible
from sluice.runtime.processes import (
    DRIVER_VAR,
    TAG_VAR,
    driver_id,
    run_tag,
    stop_own_processes,
    sweep_leftovers,
    tagged_processes,
    tagged_run,
)

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")

SRC = str(Path(__file__).resolve().parents[2] / "src")
SLEEPER = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN if {stubborn} else signal.SIG_DFL); "
    "print('ready', flush=True); time.sleep(60)"
)


def _sleeper(tag, driver, stubborn=False):
    """A process started with the run's variables; ``stubborn`` ignores SIGTERM."""
    env = {**os.environ, TAG_VAR: tag, DRIVER_VAR: driver}
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER.format(stubborn=stubborn)], env=env, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"  # its SIGTERM handler is set
    return proc


def _wait_until(predicate, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _gone(proc, timeout=20.0):
    """Whether ``proc`` exited within ``timeout`` (it is reaped here: our child)."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_the_tag_names_the_run_dir_whatever_the_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_tag(Path("run")) == run_tag(tmp_path / "run") == run_tag(tmp_path / "x" / ".." / "run")
    assert run_tag(tmp_path / "other") != run_tag(tmp_path / "run")


def test_the_sweep_stops_a_dead_drivers_processes_and_spares_a_live_one(tmp_path):
    tag = run_tag(tmp_path)
    live_driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead, stubborn, alive = None, None, None
    try:
        dead = _sleeper(tag, "999999999-1")  # a driver that is gone
        stubborn = _sleeper(tag, "999999999-1", stubborn=True)  # SIGTERM ignored: SIGKILL after the grace
        alive = _sleeper(tag, driver_id(live_driver.pid))  # another live run's
        assert sweep_leftovers(tag, grace=0.5) == 2
        assert _gone(dead) and _gone(stubborn)
        assert dead.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
        assert alive.poll() is None and [p.pid for p in tagged_processes(tag)] == [alive.pid]
    finally:
        for proc in (live_driver, dead, stubborn, alive):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_the_end_of_a_run_stops_its_own_processes_only(tmp_path):
    tag = run_tag(tmp_path)
    mine = _sleeper(tag, driver_id(os.getpid()))
    theirs = _sleeper(tag, "999999999-1")
    try:
        assert sweep_leftovers(tag, grace=0.5) == 1  # at start-up, the current driver's are not leftovers
        assert mine.poll() is None
        assert stop_own_processes(tag, settle=0.0, grace=0.5) == 1
        assert _gone(mine)
    finally:
        for proc in (mine, theirs):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("ending", ["normal", "crash"])
def test_a_tagged_run_sets_the_environment_then_puts_it_back(tmp_path, monkeypatch, ending):
    """On the way out, by its end or by an exception: its processes stopped, the environment back."""
    monkeypatch.setattr(processes, "SETTLE_S", 0.5)
    monkeypatch.delenv(TAG_VAR, raising=False)
    monkeypatch.setenv(DRIVER_VAR, "before")
    with pytest.raises(RuntimeError) if ending == "crash" else contextlib.nullcontext(), tagged_run(tmp_path) as tag:
        assert os.environ[TAG_VAR] == tag == run_tag(tmp_path)
        assert os.environ[DRIVER_VAR] == driver_id(os.getpid())
        # the reaper is a fresh interpreter: until it has exec'd, /proc shows the fork's parent
        _wait_until(lambda: [p for p in tagged_processes(tag) if "processes.py" in p.name], "the reaper")
        reapers = [p for p in tagged_processes(tag) if "processes.py" in p.name]
        assert len(reapers) == 1
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # inherits the tag
        _wait_until(lambda: child.pid in {p.pid for p in tagged_processes(tag)}, "the child's environment")
        if ending == "crash":
            raise RuntimeError("the run failed")
    assert _gone(child, timeout=5.0) and child.returncode == -signal.SIGTERM  # stopped on the way out
    assert TAG_VAR not in os.environ and os.environ[DRIVER_VAR] == "before"
    assert tagged_processes(tag) == []  # the reaper was told the run ended and exited


DRIVER = textwrap.dedent(
    """
    import subprocess, sys, time
    sys.path.insert(0, {src!r})
    from sluice.runtime.processes import tagged_run
    with tagged_run({run_dir!r}):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(60)
    """
)


def test_the_reaper_stops_the_processes_of_a_sigkilled_driver(tmp_path):
    """The child is in a session of its own: killing the driver's process group would not reach it."""
    script = DRIVER.format(src=SRC, run_dir=str(tmp_path))
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(driver.stdout.readline())
        tag = run_tag(tmp_path)
        _wait_until(lambda: child in {p.pid for p in tagged_processes(tag)}, "the child")
        driver.kill()
        driver.wait()
        _wait_until(lambda: not tagged_processes(tag), "the reaper's sweep")  # the child, then the reaper
        assert driver_id(child) is None
    finally:
        driver.kill()
        driver.wait()


UNTAGGED_DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    sys.path.insert(0, {src!r})
    from sluice.runtime.processes import tagged_run
    bare = {{"PATH": os.environ["PATH"]}}  # what /proc shows of a process that overwrote its environment
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    before = subprocess.Popen(argv, env=bare, start_new_session=True)  # not the run's
    time.sleep(0.05)  # a clock tick: /proc's start times count in 10 ms
    with tagged_run({run_dir!r}):
        child = subprocess.Popen(argv, env=bare, start_new_session=True)
        print(before.pid, child.pid, flush=True)
        time.sleep(60)
    """
)


def test_the_reaper_stops_a_descendant_that_lost_its_tag(tmp_path):
    """Ray's agents overwrite the environment ``/proc`` shows when they set their title: the
    reaper knows them as the driver's descendants started during the run (one the driver
    started before the run is left alone)."""
    script = UNTAGGED_DRIVER.format(src=SRC, run_dir=str(tmp_path))
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    before = child = None
    try:
        before, child = map(int, driver.stdout.readline().split())
        assert child not in {p.pid for p in tagged_processes(run_tag(tmp_path))}
        time.sleep(3 * processes.LINEAGE_S)  # the reaper has noted the child's ancestry
        driver.kill()
        driver.wait()
        _wait_until(lambda: driver_id(child) is None, "the reaper to stop the untagged child")
        time.sleep(0.5)  # every SIGTERM of the reaper went out before the child died
        assert driver_id(before) is not None
    finally:
        driver.kill()
        driver.wait()
        for pid in (before, child):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, signal.SIGKILL)


def test_the_first_signal_is_a_request_and_the_handlers_are_put_back():
    before = signal.getsignal(signal.SIGTERM)
    with preemptible("") as preemption:
        assert not preemption.requested
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_until(lambda: preemption.requested, "the handler")
        assert preemption.signal == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    stopped = RunPreempted(signal.SIGTERM, 3, Path("runs/x/checkpoints/step_000003"))
    assert stopped.exit_code == 143 and "resume=auto" in str(stopped) and "step_000003" in str(stopped)
    assert RunPreempted(signal.SIGINT, 0, None).exit_code == 130


SIGNALLED = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    sys.path.insert(0, {src!r})
    from sluice.runtime.preemption import preemptible
    from sluice.runtime.processes import tagged_run
    with tagged_run({run_dir!r}) as tag, preemptible(tag):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the second: out at once
        time.sleep(60)
    """
)


def test_a_second_signal_kills_the_run_at_once(tmp_path):
    script = SIGNALLED.format(src=SRC, run_dir=str(tmp_path))
    started = time.monotonic()
    driver = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert driver.returncode == 143 and time.monotonic() - started < 30
    assert "send it again to stop now" in driver.stderr and "stopping now" in driver.stderr
    child = int(driver.stdout.split()[0])
    _wait_until(lambda: driver_id(child) is None, "the child killed")
    assert tagged_processes(run_tag(tmp_path)) == []


def test_ray_actors_get_the_run_tag_in_their_runtime_env(monkeypatch):
    """A cluster this driver did not start does not inherit its environment: the actors get it."""
    from sluice.runtime.ray_pipeline import _runtime

    monkeypatch.setenv(TAG_VAR, "abc")
    monkeypatch.setenv(DRIVER_VAR, "1-2")
    env = _runtime(1, False)["runtime_env"]["env_vars"]
    assert env[TAG_VAR] == "abc" and env[DRIVER_VAR] == "1-2"
