"""Training strategies over real process groups (gloo, 2 spawned ranks): ``ddp`` and ``fsdp2`` give
one process's per-update losses over 5 steps of PPO mini-batches and epochs; a rank that plans
only its own samples does not; ``fsdp2`` publishes its weights one bucket at a time and round-trips
a sharded (DCP) checkpoint with its LR schedule; bf16 compute stays close to float32."""

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


def _rank_trains_lora(rank: int, samples: list[Sample]) -> list[dict]:
    from sluice.engines.lora import LoraSpec

    engine = _engine(torch.float32, lora=LoraSpec(4, 16.0, ("q_proj", "v_proj")))
    if rank >= 0:
        engine.distribute("ddp")
    owned = [i for i, s in enumerate(samples) if (s.group_id == 1) == (rank == 1)] if rank >= 0 else None
    return _train(engine, samples, owned, steps=2)


def test_lora_adapters_train_under_ddp_as_in_one_process(stale):
    one = _rank_trains_lora(-1, stale)
    ranks = run_ranks(_rank_trains_lora, 2, stale)
    summed = [a["loss"] + b["loss"] for a, b in zip(*ranks, strict=True)]
    assert summed == pytest.approx([u["loss"] for u in one], rel=1e-4)
    assert [u["grad_norm"] for u in ranks[0]] == pytest.approx([u["grad_norm"] for u in one], rel=1e-4)


def _ppo_steps(rank: int, samples: list[Sample], values: list[list[float]], model_dir: str) -> list[dict]:
    """3 PPO steps with a critic (2 mini-batches × 2 epochs); ``rank`` -1: one process."""
    from sluice.engines.critic import CriticEngine
    from sluice.trainer.ppo import StepShare, ppo_critic_step

    actor, critic = _engine(), CriticEngine(model_dir, lr=1e-2, token_budget=24)
    critic.model.double()
    mine = [i for i, s in enumerate(samples) if rank < 0 or (s.group_id == 1) == (rank == 1)]
    if rank >= 0:
        actor.distribute("ddp")
        critic.distribute("ddp")
    share = StepShare(samples, values, mine)
    held, held_values = [samples[i] for i in mine], [values[i] for i in mine]
    algorithm = GRPOAlgorithm(estimator="gae")
    return [
        ppo_critic_step(actor, critic, held, algorithm, 64, SCHEDULE, 1.0, 1.0, 0.95, held_values, share)
        for _ in range(3)
    ]


def test_two_ranks_train_actor_and_critic_as_one_process(stale, tmp_path):
    tiny_llama(0).save_pretrained(tmp_path)
    rng = torch.Generator().manual_seed(0)
    values = [torch.randn(len(s.response_ids), generator=rng).tolist() for s in stale]
    one = _ppo_steps(-1, stale, values, str(tmp_path))
    ranks = run_ranks(_ppo_steps, 2, stale, values, str(tmp_path))
    for key in ("loss", "value_loss", "value_tokens"):
        summed = [a[key] + b[key] for a, b in zip(*ranks, strict=True)]
        assert summed == pytest.approx([m[key] for m in one], rel=1e-5, abs=1e-9), key
    for key in ("grad_norm", "value_grad_norm", "return_mean"):
        assert [m[key] for m in ranks[0]] == pytest.approx([m[key] for m in one], rel=1e-5), key
