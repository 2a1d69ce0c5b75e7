"""The run's CPU meter counts this process and its descendants, by role, and the bench bound."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sluice.bench.e2e import bound_vs_first, format_table
from sluice.telemetry.cpu import PROC, CpuMeter, run_processes

BURN = (
    "import time\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.3:\n"
    "    pass\n"
    "print('burnt', flush=True)\n"
    "time.sleep(60)\n"
)

pytestmark = pytest.mark.skipif(not PROC.is_dir(), reason="reads /proc (Linux)")


def test_a_child_and_the_driver_are_counted_apart() -> None:
    meter = CpuMeter()
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "burnt"
        assert child.pid in run_processes()  # a descendant of this process
        start = time.process_time()
        while time.process_time() - start < 0.2:  # the driver burns too
            pass
        cpu = meter.read()
    finally:
        child.kill()
        child.wait()
    assert cpu["cpu_other"] >= 0.25  # the child's 0.3 s, not the driver's
    assert cpu["cpu_driver"] >= 0.15
    roles = sum(v for k, v in cpu.items() if k.startswith("cpu_") and k != "cpu_total")
    assert cpu["cpu_total"] == pytest.approx(roles, abs=0.01)
    assert cpu["cores"] >= 1


def test_the_bench_table_shows_the_cpu_bound_and_the_most_it_allows_against_sync() -> None:
    row = {
        "variant": "sync", "trained_tokens": 1000.0, "trained_tokens_per_s": 100.0, "loop_s": 10.0,
        "trainer_idle_fraction": 0.5, "exposed_weight_sync_s": 0.0, "staleness": {"0": 3.0},
        "base_accuracy": 0.1, "final_accuracy": 0.2, "cpu_s": 24.0, "cpu_bound_s": 12.0,
    }  # fmt: skip
    fast = {**row, "variant": "async", "trained_tokens": 900.0, "cpu_s": 8.0, "cpu_bound_s": 4.0,
            "weight_load_s_per_version": 0.0123, "logprob_gap_mean": 0.0005}  # fmt: skip
    line = format_table([row, fast, {**row, "cpu_s": None, "cpu_bound_s": None}]).splitlines()
    assert "24.0" in line[2] and "12.0" in line[2] and "0.83x" in line[2]  # 1000 tokens / 12 s vs 100 tok/s
    assert "2.25x" in line[3]  # 900 tokens / 4 s vs 100 tok/s: the most async could reach on this work
    assert "0.0123" in line[3] and "0.0005" in line[3]  # weight load seconds per version, log-prob gap
    assert line[4].count("n/a") == 5
    assert bound_vs_first(fast, row) == pytest.approx(2.25)
    assert bound_vs_first({**row, "cpu_bound_s": None}, row) is None


def test_the_bench_table_shows_no_accuracy_for_a_run_without_evaluation() -> None:
    row = {
        "variant": "sync", "trained_tokens_per_s": 100.0, "loop_s": 10.0, "trainer_idle_fraction": 0.5,
        "exposed_weight_sync_s": 0.0, "staleness": {"0": 3.0}, "base_accuracy": 0.1, "final_accuracy": 0.2,
        "cpu_s": 24.0, "cpu_bound_s": 12.0, "trained_tokens": 1000.0,
    }  # fmt: skip
    lines = format_table([row, {**row, "base_accuracy": None, "final_accuracy": None}]).splitlines()
    assert lines[2].endswith("10.0→20.0") and lines[3].endswith("n/a")  # run.eval_every=0: None accuracies
