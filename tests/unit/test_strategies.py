"""Training strategies over real process groups (gloo, 2 spawned ranks): ``ddp`` and ``fsdp2`` give
one process's per-update losses over 5 steps of PPO mini-batches and epochs; a rank that plans
only its own samples does not; ``fsdp2`` publishes its weights one bucket at a time and round-trips
a sharded (DCP) checkpoint with its LR schedule; PPO's critic (valuing and trained in lockstep,
its own sharded checkpoint) and LoRA (merged weights gathered) under both strategies; bf16
compute stays close to float32."""

from __future__ import annotations

import weakref

import pytest
import torch
from harness.ranks import run_ranks
from test_updates import _fresh_and_stale

from sluice.api import Sample
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.lr_schedule import LrSchedule
from sluice.engines.strategies import GatheredWeights
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.updates import UpdateSchedule, mini_batch_plan, proximal_logprobs, run_updates
from sluice.weights import InProcessWeightSync
from tiny import tiny_llama

pytestmark = pytest.mark.scale

STEPS = 5
SCHEDULE = UpdateSchedule(2, 2, recompute_prox=True)
Trained = tuple[dict[str, torch.Tensor], list[dict[str, float]]]
"""Final weights and every optimizer update's metrics over the steps."""


def _engine(dtype: torch.dtype = torch.float64, **options) -> HFTrainEngine:
    """float64 weights by default: 20 Adam updates turn float32 rounding of a different summation
    order (2 ranks vs 1) into ~1e-4 loss differences; in float64 a real difference still shows."""
    budgets = {"forward_token_budget": 24, "padded_token_budget": 24}  # ranks run unequal numbers of forwards
    return HFTrainEngine(tiny_llama(0).to(dtype), lr=3e-2, **{**budgets, **options})


def _train(
    engine, samples: list[Sample], owned: list[int] | None, whole_step_plan: bool = True, steps: int = STEPS
) -> list[dict]:
    """``steps`` steps of ``SCHEDULE`` over this rank's ``owned`` samples (all when ``None``)."""
    algorithm = GRPOAlgorithm()
    mine = owned if owned is not None else list(range(len(samples)))
    held = [samples[i] for i in mine]
    everyone = algorithm.advantages(samples)
    updates: list[dict] = []
    for _ in range(steps):
        prox = proximal_logprobs(engine, held, SCHEDULE, 1.0)
        if whole_step_plan:
            plan = mini_batch_plan(samples, algorithm, SCHEDULE.mini_batches, mine)
        else:  # the bug the plan prevents: each rank cuts and normalises only its own samples
            plan = mini_batch_plan(held, algorithm, SCHEDULE.mini_batches)
        advantages = [everyone[i] for i in mine]
        updates += run_updates(engine, held, advantages, prox, algorithm, 64, SCHEDULE, plan)
    return updates


def _rank_trains(rank: int, strategy: str, samples: list[Sample], whole_step_plan: bool) -> Trained:
    """Rank 0 owns groups 0 and 2, rank 1 group 1, so each mini-batch spans both ranks."""
    engine = _engine()
    engine.distribute(strategy)
    owned = [i for i, s in enumerate(samples) if (s.group_id == 1) == (rank == 1)]
    updates = _train(engine, samples, owned, whole_step_plan)
    return dict(engine.export_weights().items()), updates


def _summed(ranks: list[Trained], key: str) -> list[float]:
    return [sum(u[key] for u in per_rank) for per_rank in zip(*(updates for _, updates in ranks), strict=True)]


@pytest.fixture(scope="module")
def stale() -> list[Sample]:
    return _fresh_and_stale()[1]  # 3 groups of 4, variable lengths, off-policy


@pytest.fixture(scope="module")
def one_process(stale) -> Trained:
    engine = _engine()
    updates = _train(engine, stale, None)
    return dict(engine.export_weights()), updates


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_equal_one_process_over_five_steps_of_mini_batches_and_epochs(strategy, stale, one_process):
    one_weights, one = one_process
    ranks = run_ranks(_rank_trains, 2, strategy, stale, True)
    assert len(one) == STEPS * SCHEDULE.updates
    assert _summed(ranks, "loss") == pytest.approx([u["loss"] for u in one], rel=1e-5, abs=1e-7)
    assert [u["grad_norm"] for u in ranks[0][1]] == pytest.approx([u["grad_norm"] for u in one], rel=1e-4)
    assert _summed(ranks, "tokens") == [u["tokens"] for u in one]
    for name, value in one_weights.items():
        torch.testing.assert_close(ranks[0][0][name], value, atol=3e-4, rtol=1e-4)
        assert torch.equal(ranks[0][0][name], ranks[1][0][name])  # the ranks hold one model


def test_ranks_that_plan_only_their_own_samples_differ(stale, one_process):
    wrong = run_ranks(_rank_trains, 2, "ddp", stale, False)
    assert _summed(wrong, "loss") != pytest.approx([u["loss"] for u in one_process[1]], abs=1e-3)


def _publishes_in_buckets(rank: int, bucket_bytes: int) -> tuple[int, int, int, dict[str, torch.Tensor]]:
    """(most bytes of gathered tensors alive at once, largest tensor, all bytes, what was published)."""
    engine = _engine(weight_bucket_bytes=bucket_bytes)
    engine.distribute("fsdp2")
    weights = engine.export_weights()
    assert isinstance(weights, GatheredWeights)
    if rank > 0:
        weights.drain()
        return 0, 0, 0, {}
    seen: list[tuple[weakref.ref, int]] = []
    most = largest = 0
    sync = InProcessWeightSync()
    original = weights.items

    def watched():  # what InProcessWeightSync.publish reads, measured after each tensor it copies
        nonlocal most, largest
        for name, tensor in original():
            size = tensor.numel() * tensor.element_size()
            seen.append((weakref.ref(tensor), size))
            largest = max(largest, size)
            yield name, tensor
            del tensor
            most = max(most, sum(size for ref, size in seen if ref() is not None))

    weights.items = watched  # type: ignore[method-assign]
    sync.publish(weights, 1)
    return most, largest, sum(size for _, size in seen), dict(sync.fetch(1))


def test_fsdp2_gathers_and_publishes_one_bucket_at_a_time():
    bucket = 64 << 10
    (most, largest, total, published), _ = run_ranks(_publishes_in_buckets, 2, bucket)
    assert total > 4 * bucket  # several buckets, so holding them all would show
    assert most <= bucket + largest
    for name, value in tiny_llama(0).state_dict().items():
        assert torch.equal(published[name], value), name


def _resumes(rank: int, samples: list[Sample], path: str) -> tuple[list[float], list[float]]:
    """Losses of steps 2-3 trained straight on, and after a sharded checkpoint at step 1."""
    schedule = LrSchedule("cosine", 1, 3 * SCHEDULE.updates)
    owned = [i for i, s in enumerate(samples) if (s.group_id == 1) == (rank == 1)]
    engine = _engine(lr_schedule=schedule)
    engine.distribute("fsdp2")
    _train_steps(engine, samples, owned, 1)
    engine.save(path)
    straight = _train_steps(engine, samples, owned, 2)
    again = _engine(lr_schedule=schedule)
    again.distribute("fsdp2")
    again.load(path)
    return straight, _train_steps(again, samples, owned, 2)


def _train_steps(engine, samples, owned, steps) -> list[tuple[float, float]]:
    return [(u["loss"], u["lr"]) for u in _train(engine, samples, owned, steps=steps)]


def test_fsdp2_sharded_checkpoint_resumes_weights_optimizer_and_lr_schedule(stale, tmp_path):
    results = run_ranks(_resumes, 2, stale, str(tmp_path / "ckpt"))
    for straight, resumed in results:
        assert resumed == straight  # Adam moments and the cosine schedule continue where they stopped
    assert len({lr for _, lr in results[0][0]}) > 1
    assert sorted(p.name for p in (tmp_path / "ckpt" / "dcp").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # each rank wrote its own shard


def test_bf16_compute_stays_close_to_float32(stale):
    fp32 = _engine(torch.float32)
    bf16 = HFTrainEngine(tiny_llama(0), lr=3e-2, dtype=torch.bfloat16)
    a, b = fp32.logprobs(stale, 1.0), bf16.logprobs(stale, 1.0)
    gap = max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    assert 0 < gap < 0.05  # bf16 really ran (not bit-equal), and stays near
    assert next(bf16.model.parameters()).dtype == torch.float32  # master weights stay float32
    update = _train(bf16, stale, None)[0]
    assert torch.isfinite(torch.tensor(update["loss"])) and update["grad_norm"] > 0


def test_activation_checkpointing_recomputes_to_the_same_gradients(stale):
    plain, recomputed = _engine(torch.float32), _engine(torch.float32, activation_checkpointing=True)
    assert recomputed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    a, b = _train(plain, stale, None, steps=1), _train(recomputed, stale, None, steps=1)
    assert [u["loss"] for u in b] == pytest.approx([u["loss"] for u in a], rel=1e-6)
    assert [u["grad_norm"] for u in b] == pytest.approx([u["grad_norm"] for u in a], rel=1e-5)


def _rank_trains_lora(rank: int, samples: list[Sample], strategy: str, path: str) -> Trained:
    """2 steps of LoRA adapters; the merged weights published, and the final model saved to ``path``."""
    from sluice.engines.lora import LoraSpec

    engine = _engine(torch.float32, lora=LoraSpec(4, 16.0, ("q_proj", "v_proj")))
    if rank >= 0:
        engine.distribute(strategy)
    owned = [i for i, s in enumerate(samples) if (s.group_id == 1) == (rank == 1)] if rank >= 0 else None
    updates = _train(engine, samples, owned, steps=2)
    merged = dict(engine.export_weights().items())  # every rank reads it (fsdp2: gathered)
    engine.save(path, optimizer=False)
    return merged, updates


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lora_adapters_train_as_in_one_process(strategy, stale, tmp_path):
    from transformers import AutoModelForCausalLM

    one_weights, one = _rank_trains_lora(-1, stale, "single", str(tmp_path / "one"))
    ranks = run_ranks(_rank_trains_lora, 2, stale, strategy, str(tmp_path / strategy))
    summed = [a["loss"] + b["loss"] for a, b in zip(ranks[0][1], ranks[1][1], strict=True)]
    assert summed == pytest.approx([u["loss"] for u in one], rel=1e-4)
    assert [u["grad_norm"] for u in ranks[0][1]] == pytest.approx([u["grad_norm"] for u in one], rel=1e-4)
    assert set(ranks[0][0]) == set(one_weights) == set(tiny_llama(0).state_dict())  # the plain model's names
    base = tiny_llama(0).state_dict()
    adapted = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(one_weights[adapted], base[adapted], atol=1e-4)  # the adapters are merged in
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / strategy).state_dict()
    for name, value in one_weights.items():
        torch.testing.assert_close(ranks[0][0][name], value, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(saved[name], value, atol=1e-4, rtol=1e-4)
    assert (tmp_path / strategy / "adapter" / "adapter_model.safetensors").is_file()


def _ppo_steps(
    rank: int, samples: list[Sample], values: list[list[float]] | None, model_dir: str, strategy: str = "ddp"
) -> list[dict]:
    """``STEPS`` PPO steps with a critic (2 mini-batches × 2 epochs); ``rank`` -1: one process. ``values``
    ``None``: the critic values each step's samples itself (sync mode)."""
    from sluice.engines.critic import CriticEngine
    from sluice.trainer.ppo import StepShare
    from sluice.trainer.rl_step import train_global_batch

    actor, critic = _engine(), CriticEngine(model_dir, lr=1e-2, token_budget=24)
    critic.model.double()
    mine = [i for i, s in enumerate(samples) if rank < 0 or (s.group_id == 1) == (rank == 1)]
    if rank >= 0:
        actor.distribute(strategy)
        critic.distribute(strategy)
    held = [samples[i] for i in mine]
    algorithm = GRPOAlgorithm(estimator="gae")
    steps = []
    for _ in range(STEPS):
        if values is None:  # every rank values its own samples, then shares them (as the trainer ranks do)
            held_values = critic.values(held)
            everyone = _all_gathered(rank, mine, held_values, len(samples))
        else:
            held_values, everyone = [values[i] for i in mine], values
        share = StepShare(samples, everyone, mine)
        steps.append(
            train_global_batch(
                actor, held, algorithm, 64, SCHEDULE, 1.0, critic=critic, lam=0.95, values=held_values, share=share
            )
        )
    return steps


def _all_gathered(rank: int, mine: list[int], rows: list[list[float]], total: int) -> list[list[float]]:
    if rank < 0:
        return rows
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dict(zip(mine, rows, strict=True)))
    merged = {i: row for part in parts for i, row in part.items()}
    return [merged[i] for i in range(total)]


@pytest.mark.parametrize(("strategy", "valued"), [("ddp", "queue"), ("fsdp2", "queue"), ("fsdp2", "critic")])
def test_two_ranks_train_actor_and_critic_as_one_process(strategy, valued, stale, tmp_path):
    tiny_llama(0).save_pretrained(tmp_path)
    rng = torch.Generator().manual_seed(0)
    values = [torch.randn(len(s.response_ids), generator=rng).tolist() for s in stale] if valued == "queue" else None
    one = _ppo_steps(-1, stale, values, str(tmp_path))
    ranks = run_ranks(_ppo_steps, 2, stale, values, str(tmp_path), strategy)
    for key in ("loss", "value_loss", "value_tokens"):
        summed = [a[key] + b[key] for a, b in zip(*ranks, strict=True)]
        assert summed == pytest.approx([m[key] for m in one], rel=1e-5, abs=1e-9), key
    for key in ("grad_norm", "value_grad_norm", "return_mean"):
        assert [m[key] for m in ranks[0]] == pytest.approx([m[key] for m in one], rel=1e-5), key


def _critic_resumes(rank: int, samples: list[Sample], model_dir: str, path: str) -> tuple[dict, dict]:
    """An fsdp2 critic's second update, trained straight on and after a sharded save / load."""
    from sluice.engines.critic import CriticEngine

    def fresh() -> CriticEngine:
        critic = CriticEngine(model_dir, lr=1e-2, token_budget=24)
        critic.distribute("fsdp2")
        return critic

    mine = [s for s in samples if (s.group_id == 1) == (rank == 1)]
    returns = [[1.0] * len(s.response_ids) for s in mine]
    critic = fresh()
    critic.train_step(mine, returns, critic.values(mine))
    critic.save(path)
    straight = critic.train_step(mine, returns, critic.values(mine))
    again = fresh()
    again.load(path)
    return straight, again.train_step(mine, returns, again.values(mine))


def test_fsdp2_critic_checkpoint_holds_each_ranks_shard(stale, tmp_path):
    tiny_llama(0).save_pretrained(tmp_path / "model")
    (tmp_path / "ckpt").mkdir()
    results = run_ranks(_critic_resumes, 2, stale, str(tmp_path / "model"), str(tmp_path / "ckpt"))
    for straight, resumed in results:
        assert resumed == straight  # weights and Adam moments restored
    shards = sorted(p.name for p in (tmp_path / "ckpt" / "critic_dcp").iterdir() if p.suffix == ".distcp")
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
