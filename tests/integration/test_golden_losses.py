"""Golden losses: a short seeded run's per-step numbers and final weights, pinned.

The guard for restructuring (torchtune's recipe tests): ``run.mode: sync`` and η = 0 streaming
on both backends must keep producing the numbers recorded in ``tests/golden/losses.json``. A
change that moves them regenerates the file (``SLUICE_WRITE_GOLDEN=1``) and says why in its
commit. The tolerance (relative 1e-5) absorbs only floating-point differences between CPUs; any
change to what is computed moves these numbers by far more.
"""

import json
import math
import os
from pathlib import Path

import pytest

from fakes import length_reward, paced_length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.engines.hf_model import load_causal_lm
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

GOLDEN = Path(__file__).parent.parent / "golden" / "losses.json"
KEYS = ("loss", "grad_norm", "reward_mean", "trained_tokens")
RUNS = {
    "sync": ["run.mode=sync"],
    "eta0-local": ["run.mode=async", "run.backend=local", "rollout.max_staleness=0"],
    "eta0-ray": ["run.mode=async", "run.backend=ray", "rollout.max_staleness=0"],
}


def _numbers(model_dir: Path, out: Path, name: str) -> tuple[dict[str, object], list[dict[str, object]]]:
    overrides = [
        *tiny_run_overrides(model_dir, out, name),
        "rollout.max_new_tokens=12",
        "rollout.max_batch=4",
        "trainer.micro_batch_tokens=48",
        *RUNS[name],
    ]
    reward = length_reward if name == "sync" else paced_length_reward  # η = 0 streams: see _schedule_holds
    result = RLTrainer(load_config(None, overrides), reward=reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{k: r[k] for k in ("step", *KEYS)} for r in records if r["kind"] == "train"]
    weights = load_causal_lm(result.final_model_dir).state_dict()
    checksum = math.fsum(float(t.double().abs().sum()) for t in weights.values())
    return {"steps": steps, "weight_abs_sum": checksum}, records


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.parametrize("name", list(RUNS))
def test_golden_losses(tiny_task_model, tmp_path, name, request):
    if "run.backend=local" not in RUNS[name]:  # Ray is the default backend of both modes
        request.getfixturevalue("ray_cluster")
    got, records = _numbers(tiny_task_model, tmp_path, name)
    if os.environ.get("SLUICE_WRITE_GOLDEN"):
        pinned = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**pinned, name: got}, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())[name]
    assert [s["step"] for s in got["steps"]] == [s["step"] for s in want["steps"]]
    for g, w in zip(got["steps"], want["steps"], strict=True):
        for key in KEYS:
            assert _close(g[key], w[key]), f"{name} step {w['step']}: {key} {g[key]!r} != pinned {w[key]!r}"
    assert _close(got["weight_abs_sum"], want["weight_abs_sum"]), f"{name}: final weights moved"
    _schedule_holds(name, records)
    assert (tmp_path / name / "trace.json").is_file()


def _schedule_holds(name: str, records: list[dict]) -> None:
    """What each schedule promises besides its numbers: sync never overlaps; η = 0 streams (the
    trainer starts a step before its last group is generated; the η = 0 runs score at a fixed
    50 ms per call, so a step's groups arrive spread over ≈ 0.4 s: with instant scores a fast
    engine can finish a tiny step before the trainer's first read returns, as CI once saw on a
    loaded machine) and syncs weights in the background."""
    trains = [r for r in records if r["kind"] == "train"]
    assert all(r["staleness_max"] == 0 for r in trains)
    if name == "sync":
        assert all(r["trained_before_generated"] == 0.0 and r["engine_version"] == r["step"] for r in trains)
    else:
        assert any(r["trained_before_generated"] == 1.0 for r in trains), "the trainer never overlapped generation"
        assert all(r["step"] - 1 <= r["engine_version"] <= r["step"] for r in trains)
    weights = next(r for r in records if r["kind"] == "weights")  # read back from each worker
    assert weights["engine_version"] == weights["trainer_version"] == 3
    assert weights["engine_checksum"] == weights["trainer_checksum"]
    assert next(r for r in records if r["kind"] == "fates")["groups_trained"] == 3 * 4
