"""``sluice train`` with ``trainer.strategy: fsdp2`` as one rank on the local backend: the trainer
joins a one-rank group of its own, trains in lockstep mode, publishes gathered weights to the
engine each step and writes a final model that ``from_pretrained`` reads. In a subprocess: a
process joins one torch.distributed group in its life."""

import json
import subprocess
import sys

import pytest

from sluice.engines.hf_model import load_causal_lm
from tiny import tiny_run_overrides

pytestmark = pytest.mark.scale


def test_fsdp2_one_rank_trains_on_the_local_backend(tiny_task_model, tmp_path):
    run = [*tiny_run_overrides(tiny_task_model, tmp_path, "fsdp2"), "run.backend=local", "run.steps=2",
           "run.eval_every=0", "rollout.max_new_tokens=12", "reward.pool_size=0", "trainer.strategy=fsdp2"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "train", *run], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "fsdp2" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["version"] for r in train] == [1.0, 2.0]
    weights = next(r for r in records if r["kind"] == "weights")
    assert weights["engine_version"] == weights["trainer_version"] == 2
    assert weights["engine_checksum"] == weights["trainer_checksum"]  # the gathered weights reached the engine
    model = load_causal_lm(tmp_path / "fsdp2" / "final_model")
    assert sum(p.numel() for p in model.parameters()) > 0
