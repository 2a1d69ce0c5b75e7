"""The driver of a real ``sluice train`` (tiny model, ``run.backend`` ``local`` and ``ray``, its own
local Ray instance) killed or signalled at start-up, mid-step and mid-checkpoint.

Whatever the moment, no process carrying the run's tag is left a few seconds later (a ``/proc``
scan). SIGKILL reaches the driver alone (its children are not signalled by the test): they go
through Ray's fate sharing and sluice's reaper. SIGTERM / SIGINT stop the run at the next step
boundary with a checkpoint (``run.checkpoint_every: 0`` mid-step: the preemption writes it
anyway), one line and exit code 143 / 130; ``resume=auto`` then trains every admitted sample
exactly once (the multiset check of ``test_resume.py``).
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration.test_resume import _steps_logged, trained_ids
from sluice.runtime.processes import run_tag, tagged_processes
from tiny import tiny_run_overrides

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")]

STEPS = 6
"""Steps of a run. The mid-step signal comes a random 0-0.2 s after step 1 is logged, and a tiny
local-backend step takes well under 0.1 s: each reward call waits 0.1 s (``reward.latency_s``, no
CPU) and five steps remain, so a loaded machine's late poll still finds the run mid-way (with 4
steps and no wait, all 4 were once done)."""
GROUPS, GROUP_SIZE = 4, 4  # rollout.prompts_per_step, rollout.group_size of tiny_run_overrides
LEFTOVER_GRACE_S = 30.0
"""How long the run's processes have to be gone after the driver is (Ray's agents take seconds)."""


def _overrides(model_dir, out, name, backend, *extra):
    small = ["rollout.max_new_tokens=12", "task.eval_prompts=4", "run.mode=async", "rollout.max_staleness=0"]
    small += ["reward.latency_s=0.1"]
    return [*tiny_run_overrides(model_dir, out, name), *small, f"run.backend={backend}", f"run.steps={STEPS}", *extra]


def _train(args, log: Path) -> subprocess.Popen:
    with log.open("ab") as err:  # a file, not a pipe: Ray's start-up lines cannot fill it and block the driver
        return subprocess.Popen([sys.executable, "-m", "sluice.cli", "train", *args], stdout=err, stderr=err)


def _wait_for(predicate, what, driver, timeout=600.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert driver.poll() is None, f"the run ended (rc {driver.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _named(run_dir, *names):
    """Whether a process of the run whose name holds one of ``names`` is running."""
    return any(n in p.name for p in tagged_processes(run_tag(run_dir)) for n in names)


def _in_checkpoint(run_dir, driver):
    """Stop the driver (SIGSTOP) while a checkpoint is being written: True, stopped; False: the
    write ended before the driver stopped (it runs on)."""
    root = run_dir / "checkpoints"
    _wait_for(lambda: root.is_dir() and any(root.glob(".tmp-*")), "a checkpoint being written", driver)
    os.kill(driver.pid, signal.SIGSTOP)
    if any(root.glob(".tmp-*step_*")):
        return True
    os.kill(driver.pid, signal.SIGCONT)
    return False


def _hit(driver, run_dir, backend, moment, sig):
    """Deliver ``sig`` to the driver alone at ``moment``."""
    if moment == "start-up":  # the run is tagged (its reaper is up) and Ray or the workers are starting
        names = ("raylet",) if sig == signal.SIGKILL else ("ray::RolloutWorker",)
        _wait_for(lambda: _named(run_dir, *(names if backend == "ray" else ("processes.py",))), "start-up", driver)
        os.kill(driver.pid, sig)
    elif moment == "mid-step":  # step 1 logged: somewhere in step 2
        _wait_for(lambda: _steps_logged(run_dir) >= 1, "step 1", driver)
        time.sleep(random.uniform(0.0, 0.2))
        os.kill(driver.pid, signal.SIGSTOP)  # held while we look: a loaded machine may delay this thread
        assert _steps_logged(run_dir) < STEPS, "the run trained its last step before the signal"
        os.kill(driver.pid, sig)
        os.kill(driver.pid, signal.SIGCONT)
    else:
        while not _in_checkpoint(run_dir, driver):
            time.sleep(0.01)
        os.kill(driver.pid, sig)
        os.kill(driver.pid, signal.SIGCONT)


def _no_leftovers(run_dir):
    tag = run_tag(run_dir)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the run left running: {left}"


def _exactly_once(run_dir):
    ids, steps = trained_ids(run_dir)
    assert steps == list(range(1, STEPS + 1))
    assert set(ids.values()) == {1}  # η = 0, nothing filtered: groups 0 .. STEPS·B - 1, each sample once
    assert set(ids) == {f"{g}-{k}" for g in range(STEPS * GROUPS) for k in range(GROUP_SIZE)}


CASES = [
    (backend, sig, moment)
    for backend in ("local", "ray")
    for sig in (signal.SIGKILL, signal.SIGTERM)
    for moment in ("start-up", "mid-step", "mid-checkpoint")
] + [("local", signal.SIGINT, "mid-step")]


@pytest.mark.parametrize(
    ("backend", "sig", "moment"), CASES, ids=[f"{b}-{signal.Signals(s).name}-{m}" for b, s, m in CASES]
)
def test_driver_killed_or_signalled_leaves_nothing_and_resumes(tiny_task_model, tmp_path, backend, sig, moment):
    run_dir, log = tmp_path / "run", tmp_path / "stderr.txt"
    every = "run.checkpoint_every=1" if moment == "mid-checkpoint" else "run.checkpoint_every=0"
    args = _overrides(tiny_task_model, tmp_path, "run", backend, every, "run.keep_checkpoints=10")
    driver = _train(args, log)
    try:
        _hit(driver, run_dir, backend, moment, sig)
        rc = driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    _no_leftovers(run_dir)
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
        return
    said = log.read_text()
    assert rc == 128 + sig, said[-3000:]
    name = signal.Signals(sig).name
    lines = [line for line in said.splitlines() if line.startswith(f"stopped by {name}")]
    assert len(lines) == 1 and "run again with resume=auto" in lines[0], said[-3000:]
    logged = trained_ids(run_dir)[1] if (run_dir / "trained_ids.jsonl").is_file() else []
    if moment == "start-up":
        assert logged == [] and "no new checkpoint" in lines[0]
        return
    step = logged[-1]
    assert f"at step {step}: checkpoint {run_dir / 'checkpoints' / f'step_{step:06d}'}" in lines[0]
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "COMPLETE").is_file()
    if sig == signal.SIGINT:
        return
    resumed = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "train", *args, "resume=auto"], capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _exactly_once(run_dir)
    _no_leftovers(run_dir)
