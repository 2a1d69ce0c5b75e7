"""A real ``sluice train`` (the Ray backend, as ``make run``; 2 steps of the tiny model) prints
only sluice's own lines: Ray's start-up lines (token auth, "Started a local Ray instance"), its
C++ core worker's ``core_worker.cc`` line and libraries' warnings land in ``<run dir>/run.log``."""

import os
import re
import subprocess
import sys

import pytest

from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

OWN_LINES = re.compile(r"(model .* run dir .*|train \d+/\d+ .*|steps \d+ in .*|accuracy [\d.]+ -> [\d.]+)")
"""What sluice prints in a run without a progress bar (its progress lines, then its results)."""


@pytest.mark.scale  # its own Ray instance, as `make run` starts one, and three actors: 20–22 s on 2 cores
def test_a_run_prints_only_sluices_lines_and_the_rest_goes_to_run_log(tiny_task_model, tmp_path):
    overrides = [*tiny_run_overrides(tiny_task_model, tmp_path, "console"), "run.steps=2", "run.backend=ray"]
    env = {**os.environ, "COLUMNS": "500"}  # rich wraps at 80 columns when stdout is no terminal
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "train", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and all(OWN_LINES.fullmatch(line) for line in lines), proc.stdout
    log = (tmp_path / "console" / "run.log").read_text()
    assert "Started a local Ray instance" in log and "core_worker.cc" in log
