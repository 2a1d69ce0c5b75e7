"""``sluice train`` with ``rollout.engine: vllm`` end to end (``make vllm-test``, in ``.venv-vllm``).

Short runs (3 steps of 4 groups x 4 samples, a reward with signal so every version's weights
differ) under ``run.check_weights``: after every weight sync the engines' checksum must equal
the one the trainer published for that version, or the run stops. Each run asserts every
admitted sample was trained exactly once and every version was checked:

- local backend, async η = 1, ``interrupt`` updates, weights through the shared-memory block;
- Ray backend, async η = 1, ``defer`` updates, two vLLM replicas whose workers receive every
  version over the gloo broadcast group (``fleet.weight_transfer: broadcast``) in 1 MiB buckets.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from tiny import save_tiny_task_model, tiny_run_overrides

pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make vllm-test` runs these in .venv-vllm")

STEPS, GROUPS, SIZE = 3, 4, 4
VLLM = ["rollout.engine=vllm", "vllm.kv_cache_mb=16", "vllm.max_model_len=128", "rollout.max_batch=16"]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_task_model(tmp_path_factory.mktemp("vllm_train_model"), head_dim=64)


def _fit(model_dir: Path, out: Path, name: str, *overrides: str) -> list[dict[str, Any]]:
    short = ["rollout.max_new_tokens=8", "task.eval_prompts=4", "reward.pool_size=0", "run.check_weights=true"]
    cfg = load_config(None, [*tiny_run_overrides(model_dir, out, name), *short, *VLLM, *overrides])
    result = RLTrainer(cfg, reward=length_reward).fit()
    trained = Counter(
        uid
        for line in (result.run_dir / "trained_ids.jsonl").read_text().splitlines()
        for uid in json.loads(line)["ids"]
    )
    assert set(trained.values()) == {1} and len(trained) == STEPS * GROUPS * SIZE  # each sample trained once
    return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]


def _checked(records: list[dict[str, Any]]) -> None:
    """Every version's engine checksum was compared with the trainer's (the run stops otherwise);
    the versions differ, and the run ends with both sides on the last one."""
    trains = [r for r in records if r["kind"] == "train"]
    assert len(trains) == STEPS
    checked = {r["weights_checked_version"] for r in trains if "weights_checked_version" in r}
    end = next(r for r in records if r["kind"] == "weights")
    assert checked | {end["engine_version"]} >= {float(v) for v in range(2, STEPS + 1)}
    assert len({r["weights_checksum"] for r in trains}) == STEPS  # the weights moved every step
    assert end["engine_version"] == end["trainer_version"] == STEPS
    assert end["engine_checksum"] == end["trainer_checksum"] == trains[-1]["weights_checksum"]


def test_local_async_interrupt_trains_every_sample_once_on_the_trainers_weights(vllm_model, tmp_path):
    records = _fit(
        vllm_model, tmp_path, "local", "run.backend=local", "run.mode=async", "rollout.max_staleness=1",
        "rollout.weight_update=interrupt",
    )  # fmt: skip
    _checked(records)


def test_ray_broadcast_into_two_replicas_workers_with_defer(vllm_model, tmp_path, ray_cluster):
    records = _fit(
        vllm_model, tmp_path, "ray", "run.backend=ray", "run.mode=async", "rollout.max_staleness=1",
        "rollout.weight_update=defer", "resources.rollout.replicas=2", "fleet.weight_transfer=broadcast",
        "fleet.broadcast_backend=gloo", "trainer.weight_bucket_mb=1",
    )  # fmt: skip
    _checked(records)
    end = next(r for r in records if r["kind"] == "weights")
    assert end["engine_weight_updates"] == 2 * STEPS  # each replica loaded every version from the group
