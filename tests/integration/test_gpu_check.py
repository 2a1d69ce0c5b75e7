"""``scripts/gpu_check.sh`` end to end in its small mode: the wheel step, every row, one table, JSON.

On CPU the whole script runs with ``--device cpu --small`` (tiny model, one step); with CUDA
(``@pytest.mark.gpu``) the same small mode runs on the device and must place the trainer, the
engine and the local-backend runs there. A failing row is reported and the next rows still run.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_check
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.scale]

ROOT = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path, device: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_SITE": str(tmp_path / "site"), "OUT": ""}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", device, "--small", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.is_file(), done.stderr[-3000:]
    return done, json.loads(out.read_text())


def _table_rows(stdout: str) -> list[str]:
    """The check names of the printed table's rows (its first 15 columns), in order."""
    lines = stdout.splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("check ")]
    assert len(header) == 1, stdout  # one table
    return [line[:15].strip() for line in lines[header[0] + 1 : header[0] + 1 + len(gpu_check.ROWS)]]


def test_gpu_check_small_on_cpu(tmp_path):
    done, report = _script(tmp_path, "cpu")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert _table_rows(done.stdout) == list(gpu_check.ROWS)
    status = {r["check"]: r["status"] for r in report["rows"]}
    assert list(status) == list(gpu_check.ROWS)
    assert status.pop("trainer fsdp2") == "ok"
    assert set(status.values()) == {"ok"}, report["rows"]
    rows = {r["check"]: r for r in report["rows"]}
    assert all(r["device"] == "cpu" for r in rows.values())
    assert rows["trainer single"]["tokens_per_s"] > 0 and rows["engine"]["tokens_per_s"] > 0
    assert all(abs(x) < 1e6 for x in rows["trainer single"]["losses"])
    assert rows["train sync"]["final_reward"] is not None and rows["train async"]["loop_s"] > 0


@pytest.mark.gpu
def test_gpu_check_small_on_cuda(tmp_path):
    done, report = _script(tmp_path, "cuda")
    rows = {r["check"]: r for r in report["rows"]}
    assert done.returncode == 0, json.dumps(report["rows"], indent=1)
    for name in ("trainer single", "trainer fsdp2", "engine", "train sync", "train async"):
        assert rows[name]["device"] == "cuda" and rows[name]["peak_gib"] > 0, rows[name]


def test_a_failing_row_is_reported_and_the_driver_goes_on(tmp_path):
    args = argparse.Namespace(device="cpu", small=True, model_dir=str(tmp_path / "missing"), workdir=str(tmp_path))
    row = gpu_check.run_row(args, "engine")
    assert row["status"] == "FAIL" and "ModelPathError" in row["detail"], row
    timed_out = gpu_check._child(args, "imports", timeout=0.01)
    assert timed_out["status"] == "FAIL" and "timed out" in timed_out["detail"]
