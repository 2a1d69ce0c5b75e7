"""``sluice train`` with ``rollout.engine: vllm`` end to end (``make vllm-test``, in ``.venv-vllm``).

Short runs (3 steps of 4 groups x 4 samples, a reward with signal so every version's weights
differ) under ``run.check_weights``: after every weight sync the engines' checksum must equal
the one the trainer published for that version, or the run stops. Each run asserts every
admitted sample was trained exactly once and every version was checked:

- local backend, async η = 1, ``interrupt`` updates, weights through the shared-memory block,
  stopped at a step-2 checkpoint and resumed with ``resume=auto`` (the engine starts from the
  base model and is brought to the checkpoint's version);
- Ray backend, async η = 1, ``defer`` updates, two vLLM replicas, each in its own actor
  (``replica_actors``, as on GPUs), whose workers receive every version over the gloo broadcast
  group (``fleet.weight_transfer: broadcast``) in 1 MiB buckets;
- local backend, sync: the ``guess_number`` game's two-turn episodes (a guess, the env's answer,
  a second guess), each turn one vLLM request of the episode's session.
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


def _fit(model_dir: Path, out: Path, name: str, *overrides: str, reward: Any = length_reward) -> list[dict[str, Any]]:
    short = ["rollout.max_new_tokens=8", "task.eval_prompts=4", "reward.pool_size=0", "run.check_weights=true"]
    cfg = load_config(None, [*tiny_run_overrides(model_dir, out, name), *short, *VLLM, *overrides])
    result = RLTrainer(cfg, reward=reward).fit()
    trained = Counter(
        uid
        for line in (result.run_dir / "trained_ids.jsonl").read_text().splitlines()
        for uid in json.loads(line)["ids"]
    )
    assert set(trained.values()) == {1} and len(trained) == cfg.run.steps * GROUPS * SIZE  # each trained once
    return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]


def _checked(records: list[dict[str, Any]]) -> None:
    """Every version's engine checksum was compared with the trainer's (the run stops otherwise;
    a step's record shows the last check done by then); the versions differ, and the run ends with
    both sides on the last one."""
    trains = [r for r in records if r["kind"] == "train"]
    assert len(trains) == STEPS
    checked = {r["weights_checked_version"] for r in trains if "weights_checked_version" in r}
    end = next(r for r in records if r["kind"] == "weights")
    assert checked and checked <= {float(v) for v in range(1, STEPS + 1)}
    assert len({r["weights_checksum"] for r in trains}) == STEPS  # the weights moved every step
    assert end["engine_version"] == end["trainer_version"] == STEPS
    assert end["engine_checksum"] == end["trainer_checksum"] == trains[-1]["weights_checksum"]


def test_local_async_interrupt_resumed_trains_every_sample_once_on_the_trainers_weights(vllm_model, tmp_path):
    local = ["run.backend=local", "run.mode=async", "rollout.max_staleness=1", "rollout.weight_update=interrupt"]
    _fit(vllm_model, tmp_path, "local", *local, "run.steps=2", "run.checkpoint_every=2")
    records = _fit(vllm_model, tmp_path, "local", *local, f"run.steps={STEPS}", "run.resume=auto")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, STEPS + 1))
    _checked(records)


def test_ray_broadcast_into_two_replicas_workers_with_defer(vllm_model, tmp_path, ray_cluster):
    records = _fit(
        vllm_model, tmp_path, "ray", "run.backend=ray", "run.mode=async", "rollout.max_staleness=1",
        "rollout.weight_update=defer", "resources.rollout.replicas=2", "resources.rollout.replica_actors=true",
        "fleet.weight_transfer=broadcast",
        "fleet.broadcast_backend=gloo", "trainer.weight_bucket_mb=1",
    )  # fmt: skip
    _checked(records)
    end = next(r for r in records if r["kind"] == "weights")
    assert end["engine_weight_updates"] == 2 * STEPS  # each replica loaded every version from the group


def test_sync_two_turn_episodes_through_vllm(tmp_path):
    from sluice.tasks import TASKS
    from sluice.tasks.spec import TinyLlamaSpec
    from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer(TASKS["guess_number"].alphabet)
    spec = TinyLlamaSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=256, max_position_embeddings=256)  # fmt: skip
    build_tiny_llama(spec, tok, seed=0).save_pretrained(tmp_path / "guess")
    tok.save_pretrained(tmp_path / "guess")
    game = ["task.name=guess_number", "agentic.max_turns=2", "agentic.turn_tokens=6", "agentic.group_redundancy=1"]
    records = _fit(
        tmp_path / "guess", tmp_path, "guess", "run.backend=local", "run.mode=sync", "run.steps=2",
        "trainer.micro_batch_tokens=256", *game, reward=None,
    )  # fmt: skip
    episodes = next(r for r in records if r["kind"] == "episodes")
    routed = next(r for r in records if r["kind"] == "proxy")["routed"]
    evaluated = 2 * 4  # greedy held-out episodes, base and final
    assert routed > episodes["env_episodes_started"] + evaluated  # requests beyond one per episode: second turns
    end = next(r for r in records if r["kind"] == "weights")
    assert end["engine_version"] == end["trainer_version"] == 2
    assert end["engine_checksum"] == end["trainer_checksum"]
