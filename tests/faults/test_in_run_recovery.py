"""In-run recovery in a real Ray run (issue 42, item 3): actors killed or stopped mid-run, one
after another, and the run finishes by itself.

Each case is one ``fit`` (with a reference worker: ``trainer.kl_coef``) and ``run.max_restarts``
equal to its faults: after steps 2 to 6, one after another, the trainer, the reference worker, the
queue storage unit, the queue controller and the weight registry each get SIGKILL (or, the other
case, SIGSTOP); each death or stall is named (a stall within the timeout), the workers
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
from faults.test_worker_faults import STALL_S, _actor_pids, _assert_each_sample_once, _overrides
from sluice import RLTrainer
from sluice.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STEPS = 10
"""Enough for five faults after steps 2-6, each past the checkpoint its attempt resumed from."""
KILL, STOP = signal.SIGKILL, signal.SIGSTOP


def _restarts(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    kinds = [json.loads(line).get("kind") for line in path.read_text().splitlines() if line.endswith("}")]
    return kinds.count("restart")


def _faults(run_dir: Path, plan: list[tuple[int, str, signal.Signals]]) -> threading.Thread:
    """In the background: fault ``k`` of ``plan`` (step, actor title, signal) once ``k`` restarts
    are logged and the current attempt has trained that step and one of its own (not while it
    places its workers: an actor stopped in its ``__init__`` is not named, ``docs/reliability.md``)."""

    def act() -> None:
        for k, (step, title, sig) in enumerate(plan):
            _wait_for(lambda k=k: _restarts(run_dir) == k, f"restart {k}")
            at = max(step, _steps_logged(run_dir) + 1)  # past the attempt's checkpoint: mid-loop
            _wait_for(lambda at=at: _steps_logged(run_dir) >= at, f"step {at}")
            count = 2 if title == "ray::ControllerActor" else 1  # a controller per task: train, reference
            _wait_for(lambda title=title, n=count: len(_actor_pids(title)) == n, f"{count} {title}", timeout=60)
            os.kill(min(_actor_pids(title)), sig)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


ACTORS = [  # (actor title, its name in the line): the trainer, the reference worker, the queue, the registry
    ("ray::TrainerWorker", "the trainer"),
    ("ray::NodeTaskWorker", "the 'reference' task worker"),
    ("ray::StorageActor", "the queue storage unit"),
    ("ray::ControllerActor", "the queue controller of task '"),  # one of the two
    ("ray::_Registry", "the weight registry"),
]
AFTER_STEPS = [2, 3, 4, 5, 6]
"""The fault of each actor comes once this step is trained (adjacent steps: a restart may come
before the previous one's attempt wrote a newer checkpoint)."""
LOOK_S = min(5.0, STALL_S / 4)
"""The watchdog's look interval: a stopped actor is named within ``STALL_S`` (``_overrides``'
``run.stall_timeout_s``) plus two looks."""
CASES = {"SIGKILL": (KILL, "died ("), "SIGSTOP": (STOP, "sent no heartbeat for ")}


@pytest.mark.parametrize("case", list(CASES))
def test_each_actor_killed_or_stopped_mid_run_is_recovered_and_the_run_finishes(
    tiny_task_model, tmp_path, ray_cluster, case
):
    sig, what = CASES[case]
    plan = [(step, title, sig) for step, (title, _) in zip(AFTER_STEPS, ACTORS, strict=True)]
    overrides = _overrides(tiny_task_model, tmp_path, "recover", f"run.steps={STEPS}", "trainer.kl_coef=0.05")
    overrides.append(f"run.max_restarts={len(plan)}")
    fault = _faults(tmp_path / "recover", plan)
    result = RLTrainer(load_config(None, overrides), reward=length_reward).fit()
    fault.join()
    _assert_each_sample_once(result.run_dir, run_steps=STEPS)
    restarts = [r for r in _records(result.run_dir) if r["kind"] == "restart"]
    assert [r["restart"] for r in restarts] == list(range(1, len(plan) + 1)), restarts
    for record, (_, name) in zip(restarts, ACTORS, strict=True):
        assert record["cause"].startswith(name) and f" {what}" in record["cause"] and record["step"] >= 1, restarts
        if sig == STOP:  # named within the stall timeout and the watchdog's two looks
            silent = float(record["cause"].split(" for ")[1].split(" s ")[0])
            assert STALL_S <= silent <= STALL_S + 2 * LOOK_S + 5, record
    deadline = time.monotonic() + 30  # ray.kill returns before the process has exited
    while any(_actor_pids(title) for title, _ in ACTORS) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_actor_pids(title) for title, _ in ACTORS), "an actor outlived its run"
