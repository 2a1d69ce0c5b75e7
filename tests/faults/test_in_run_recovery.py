"""In-run recovery in a real Ray run (issue 42, item 3): actors killed or stopped mid-run, one
after another, and the run finishes by itself.

Each case is one ``fit`` with ``run.max_restarts`` equal to its faults: after step 2, 4 (and 6) of
the current attempt one actor gets SIGKILL or SIGSTOP; each death or stall is named, the workers
are torn down and placed again, the run continues from its last complete checkpoint; at the end
every admitted sample was trained exactly once, one ``restart`` record per fault names its cause,
and none of the run's processes (the stopped ones included) outlives it. A chain of faults in one
run costs one Ray start-up and checks that a restarted run can itself be restarted.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_resume import _records, _steps_logged, _wait_for

from fakes import length_reward
from faults.test_worker_faults import _actor_pids, _assert_each_sample_once, _overrides
from sluice import RLTrainer
from sluice.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STEPS = 8
KILL, STOP = signal.SIGKILL, signal.SIGSTOP


def _restarts(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    kinds = [json.loads(line).get("kind") for line in path.read_text().splitlines() if line.endswith("}")]
    return kinds.count("restart")


def _faults(run_dir: Path, plan: list[tuple[int, str, signal.Signals]]) -> threading.Thread:
    """In the background: fault ``k`` of ``plan`` (step, actor title, signal) once ``k`` restarts
    are logged and the current attempt has trained that step."""

    def act() -> None:
        for k, (step, title, sig) in enumerate(plan):
            _wait_for(lambda k=k, step=step: _restarts(run_dir) == k and _steps_logged(run_dir) >= step, f"step {step}")
            _wait_for(lambda title=title: len(_actor_pids(title)) == 1, f"one {title}", timeout=60)
            os.kill(_actor_pids(title)[0], sig)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


CASES = {
    "kills": (
        [(2, "ray::TrainerWorker", KILL), (4, "ray::StorageActor", KILL), (6, "ray::_Registry", KILL)],
        ["the trainer died", "the queue storage unit died", "the weight registry died"],
        (),
    ),
    "stops": (
        [(2, "ray::TrainerWorker", STOP), (4, "ray::ControllerActor", STOP), (6, "ray::_Registry", STOP)],
        [
            "the trainer sent no heartbeat",
            "the queue controller of task 'train' sent no heartbeat",
            "the weight registry sent no heartbeat",
        ],
        (),
    ),
    "reference-worker": (
        [(2, "ray::NodeTaskWorker", KILL), (4, "ray::NodeTaskWorker", STOP)],
        ["the 'reference' task worker died", "the 'reference' task worker sent no heartbeat"],
        ("trainer.kl_coef=0.05",),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_actors_killed_or_stopped_mid_run_are_recovered_and_the_run_finishes(
    tiny_task_model, tmp_path, ray_cluster, case
):
    plan, causes, extra = CASES[case]
    overrides = _overrides(tiny_task_model, tmp_path, "recover", f"run.steps={STEPS}", *extra)
    overrides.append(f"run.max_restarts={len(plan)}")
    fault = _faults(tmp_path / "recover", plan)
    result = RLTrainer(load_config(None, overrides), reward=length_reward).fit()
    fault.join()
    _assert_each_sample_once(result.run_dir, run_steps=STEPS)
    restarts = [r for r in _records(result.run_dir) if r["kind"] == "restart"]
    assert [r["restart"] for r in restarts] == list(range(1, len(plan) + 1)), restarts
    for record, cause in zip(restarts, causes, strict=True):
        assert record["cause"].startswith(cause) and record["step"] >= 1, restarts
    deadline = time.monotonic() + 30  # ray.kill returns before the process has exited
    while any(_actor_pids(title) for _, title, _ in plan) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_actor_pids(title) for _, title, _ in plan), "a stopped actor outlived its run"
