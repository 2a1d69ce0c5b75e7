"""One owner per run dir (``runtime/run_lock.py``): a second driver is refused in one line naming
the holder, a dead holder's lock is taken over and said so, and ``fit`` takes the lock before it
reads or writes anything in the run dir."""

import json
import logging
import os
import socket

import pytest

from fakes import length_reward
from host_probes import read_holder
from sluice import RLTrainer
from sluice.cli import main
from sluice.config import load_config
from sluice.runtime.run_lock import LOCK_FILE, RunDirBusy, run_dir_lock
from tiny import tiny_run_overrides


def test_a_second_holder_is_refused_in_one_line_naming_the_first(tmp_path):
    with run_dir_lock(tmp_path / "run") as holder:
        with pytest.raises(RunDirBusy) as refused, run_dir_lock(tmp_path / "run"):
            pass
        line = str(refused.value)
        assert "\n" not in line and "in use by another driver" in line
        assert f"pid {os.getpid()} on {socket.gethostname()} since {holder['since']}" in line
        assert read_holder(tmp_path / "run") == holder  # the refused one changed nothing
    assert read_holder(tmp_path / "run") == {}  # released in order
    with run_dir_lock(tmp_path / "run"):  # and free again
        pass


def test_the_lock_of_a_holder_that_is_gone_is_taken_over_and_said_so(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = {"host": "node7", "pid": 424242, "driver": "424242-99", "since": "2026-01-01T00:00:00Z"}
    (run_dir / LOCK_FILE).write_text(json.dumps(dead) + "\n")  # its flock died with its process
    with caplog.at_level(logging.WARNING, "sluice.runtime.run_lock"), run_dir_lock(run_dir) as holder:
        assert holder["pid"] == os.getpid()
    assert "taking over" in caplog.text and "pid 424242 on node7 since 2026-01-01T00:00:00Z" in caplog.text


@pytest.mark.parametrize("resume", [[], ["run.resume=auto"]])
def test_a_second_driver_on_the_run_dir_exits_2_with_one_line_and_writes_nothing(
    tiny_task_model, tmp_path, capsys, resume
):
    args = [*tiny_run_overrides(tiny_task_model, tmp_path, "twice"), "run.backend=local", "reward.pool_size=0", *resume]
    run_dir = tmp_path / "twice"
    with run_dir_lock(run_dir):  # the first driver, mid-run
        with pytest.MonkeyPatch.context() as patch:  # said before the model loads (sluice train asks first)
            patch.setattr(RLTrainer, "init_engines", lambda *_, **__: pytest.fail("loaded the model first"))
            assert main(["train", *args]) == 2
        with pytest.raises(RunDirBusy):  # and fit itself refuses (the Python API, or a race past the probe)
            RLTrainer(load_config(None, args), reward=length_reward).fit()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"pid {os.getpid()}" in err[0], err
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # no run.json, logs, config.yaml
