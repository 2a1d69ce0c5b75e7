"""Algorithm options end to end on the tiny task model: PPO mini-batches with recomputed proximal
log-probs, a KL to the reference policy (the reference step as a queue task) and an entropy
bonus, in sync mode and on the asynchronous pipeline; LoRA; PPO with a critic in sync mode and on
the asynchronous pipeline (equal to sync at η = 0)."""

import json

import pytest
import torch

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from sluice.engines.hf_model import load_causal_lm
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

OPTIONS = [
    "trainer.ppo_mini_batches=2",
    "trainer.prox_logprobs=recompute",
    "trainer.kl_coef=0.05",
    "trainer.entropy_coef=0.01",
    "rollout.max_new_tokens=12",
    "run.eval_every=0",
]


def _train_records(model_dir, out, name, *overrides):
    cfg = load_config(None, [*tiny_run_overrides(model_dir, out, name), *OPTIONS, *overrides])
    result = RLTrainer(cfg, reward=length_reward).fit()
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


RAY_RUN = pytest.mark.scale
"""A Ray case of a run of four or more actors (≈ 4 CPU-s each to import torch and transformers):
20–30 s on 2 cores, so in ``make test-scale``; ``make test`` keeps the local cases."""


@pytest.mark.parametrize("mode", ["sync", "local", pytest.param("ray", marks=RAY_RUN)])
def test_kl_entropy_and_mini_batches_run_end_to_end(tiny_task_model, tmp_path, mode, request):
    if mode == "ray":
        request.getfixturevalue("ray_cluster")
    where = ["run.mode=sync", "run.backend=local"] if mode == "sync" else ["run.mode=async", f"run.backend={mode}"]
    records = _train_records(tiny_task_model, tmp_path, mode, *where)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["optimizer_steps"] == 2 and r["entropy_sum"] > 0 for r in records)
    # every trained token had its reference log-prob; the policy leaves the reference once it moves
    assert all(r["kl_ref_sum"] >= 0 for r in records) and records[-1]["kl_ref_sum"] > 0


def test_lora_run_syncs_merged_weights_to_the_engine(tiny_task_model, tmp_path):
    overrides = ["trainer.lora_rank=4", "trainer.lr=3e-2", "run.mode=async", "run.backend=local"]
    cfg = load_config(None, [*tiny_run_overrides(tiny_task_model, tmp_path, "lora"), *overrides])
    result = RLTrainer(cfg, reward=length_reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = next(r for r in records if r["kind"] == "weights")
    assert weights["engine_version"] == weights["trainer_version"] == 3
    assert weights["engine_checksum"] == pytest.approx(weights["trainer_checksum"], rel=1e-9)
    base = load_causal_lm(tiny_task_model).state_dict()
    final = load_causal_lm(result.final_model_dir).state_dict()  # a plain HF folder, adapters merged
    assert not torch.equal(
        final["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(final["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted


PPO = ["trainer.algorithm=ppo", "trainer.ppo_mini_batches=2", "trainer.critic_lr=1e-2"]
PPO_KEYS = ("step", "loss", "grad_norm", "value_loss", "value_mean", "return_mean", "value_clipped_tokens",
            "reward_mean", "trained_tokens", "kl_ref_sum")  # fmt: skip


def test_ppo_with_a_critic_trains_in_sync_mode(tiny_task_model, tmp_path):
    records = _train_records(tiny_task_model, tmp_path, "ppo", *PPO, "run.mode=sync", "run.backend=local")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["value_tokens"] > 0 and r["value_loss"] > 0 and r["optimizer_steps"] == 2 for r in records)
    assert records[0]["value_mean"] == 0.0 and records[-1]["value_mean"] != 0.0  # the critic learns


@pytest.fixture(scope="module")
def ppo_sync_records(tiny_task_model, tmp_path_factory):
    """The synchronous loop's PPO records per ``kl_coef``, run once for the module (the η = 0
    cases of both backends compare with the same one)."""
    runs: dict[float, list[dict]] = {}

    def records(kl_coef: float) -> list[dict]:
        if kl_coef not in runs:
            out = tmp_path_factory.mktemp("ppo-sync")
            where = [*PPO, f"trainer.kl_coef={kl_coef}", "run.mode=sync", "run.backend=local"]
            runs[kl_coef] = _train_records(tiny_task_model, out, "ppo-sync", *where)
        return runs[kl_coef]

    return records


@pytest.mark.parametrize(
    ("backend", "kl_coef"), [("local", 0.0), pytest.param("ray", 0.0, marks=RAY_RUN), ("local", 0.05)]
)
def test_ppo_with_a_critic_at_eta0_async_gives_the_sync_losses(
    tiny_task_model, tmp_path, backend, kl_coef, request, ppo_sync_records
):
    """The critic's values as a queue task (own worker, the critic the trainer publishes) and the
    critic's update in the trainer's step: at η = 0 the same losses, gradient norms, values and
    returns as the synchronous loop, bit for bit. Stale critic weights in the values worker (a
    missed publish) or values from a differently batched critic would change ``value_mean`` /
    ``return_mean`` and the losses from step 2 on. With the KL's reference task beside it the
    reference worker batches rows as they come, which moves the KL in the last digits: equal to
    float32 rounding (seen up to 1.1e-6 relative on a loaded machine, so 1e-5)."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    ppo = [*PPO, f"trainer.kl_coef={kl_coef}"]
    sync = ppo_sync_records(kl_coef)
    where = ["run.mode=async", f"run.backend={backend}", "rollout.max_staleness=0"]
    streamed = _train_records(tiny_task_model, tmp_path, f"ppo-{backend}", *ppo, *where)
    got, want = ([[r.get(k) for k in PPO_KEYS] for r in records] for records in (streamed, sync))
    if kl_coef:
        assert [pytest.approx(row, rel=1e-5) for row in got] == want
    else:
        assert got == want
    assert streamed[-1]["value_mean"] != 0.0 and all(r["staleness_max"] == 0 for r in streamed)


def test_ppo_with_a_critic_at_eta1_keeps_the_staleness_bound_and_the_fates(tiny_task_model, tmp_path):
    """η = 1: rows are valued by a critic at least as new as their policy while the trainer runs
    a version ahead; every admitted group is trained once or counted, none older than η."""
    overrides = ["run.mode=async", "run.backend=local", "rollout.max_staleness=1", "rollout.max_batch=8"]
    cfg = load_config(None, [*tiny_run_overrides(tiny_task_model, tmp_path, "ppo-eta1"), *OPTIONS, *PPO, *overrides])
    result = RLTrainer(cfg, reward=length_reward).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [1, 2, 3] and all(r["staleness_max"] <= 1 for r in trains)
    assert all(r["value_tokens"] > 0 and r["optimizer_steps"] == 2 for r in trains)
    fates = next(r for r in records if r["kind"] == "fates")
    assert fates["groups_trained"] == 12 == sum(v for k, v in fates.items() if k.startswith("staleness_"))
    weights = next(r for r in records if r["kind"] == "weights")
    assert weights["engine_version"] == weights["trainer_version"] == 3
    assert weights["engine_checksum"] == weights["trainer_checksum"]


def test_the_lr_schedule_reaches_the_trainer_actor(tiny_task_model, tmp_path, request):
    """``trainer.lr_schedule`` through the Ray trainer actor: each step's mean learning rate over
    its two mini-batch updates follows linear warmup (1 step = 2 updates) and decay over 3 steps.
    No KL or entropy term: the learning rate does not depend on them, and a KL starts a reference
    worker actor (one more process importing torch and transformers, ≈ 7 CPU-s)."""
    request.getfixturevalue("ray_cluster")
    schedule = ["trainer.lr=0.01", "trainer.lr_schedule=linear", "trainer.lr_warmup_steps=1"]
    no_reference = ["trainer.kl_coef=0", "trainer.entropy_coef=0"]
    records = _train_records(
        tiny_task_model, tmp_path, "lr", *schedule, *no_reference, "run.mode=async", "run.backend=ray"
    )
    assert [r["step"] for r in records] == [1, 2, 3]  # updates 1..6: lr .5, 1, 1, .75, .5, .25 (x 0.01)
    assert [r["lr"] for r in records] == pytest.approx([0.0075, 0.00875, 0.00375])
