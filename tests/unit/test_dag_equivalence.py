"""The built-in DAGs compute what the code paths they replace compute: same seed, same samples,
same weights in → the same metrics (losses) and the same weights out, bit for bit; and a custom
node (a second reward combined with the first) changes what the update sees."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from chain import ColocatedChain
from sluice.api import Sample
from sluice.config import TrainerConfig
from sluice.dag import compile_dag, load_dag
from sluice.dag.model_nodes import ModelBindings
from sluice.engines.critic import CriticEngine
from sluice.engines.hf_train import HFTrainEngine
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.rl_step import train_global_batch
from sluice.trainer.sections import frozen_engine
from sluice.trainer.updates import UpdateSchedule
from tiny import VOCAB, tiny_llama

torch.set_num_threads(1)
GROUP = 4
SCHEDULE = UpdateSchedule(2, 1, True)  # two mini-batches, recomputed proximal log-probs
MB_TOKENS = 64
EXAMPLE_DAG = Path(__file__).parents[2] / "examples" / "dag_two_rewards" / "dag.yaml"


def _samples(groups: int = 3, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(1, VOCAB) for _ in range(3))
        for k in range(GROUP):
            n = rng.randint(2, 16)
            resp = tuple(rng.randrange(1, VOCAB) for _ in range(n))
            behav = tuple(-rng.uniform(0.5, 3.0) for _ in range(n))
            reward = float(rng.random() < 0.5)
            out.append(Sample(f"g{g}k{k}", g, prompt, resp, behav, (0,) * n, (1,) * n, reward, {"k": k}))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dag_model")
    tiny_llama(0).save_pretrained(path)
    return path


def _same_weights(a: HFTrainEngine, b: HFTrainEngine) -> bool:
    wa, wb = a.export_weights(), b.export_weights()
    return all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("kl", [False, True])
def test_grpo_dag_gives_the_losses_of_train_global_batch(model_dir, kl):
    algo = GRPOAlgorithm(kl_coef=0.05 if kl else 0.0, kl_estimator="k3", kl_in="loss")
    direct, via_dag = HFTrainEngine(tiny_llama(0), lr=1e-2), HFTrainEngine(tiny_llama(0), lr=1e-2)
    reference = frozen_engine(model_dir, TrainerConfig(), 1.0) if kl else None
    models = ModelBindings(algo, MB_TOKENS, SCHEDULE, 1.0, actor=via_dag, reference=reference)
    chain = ColocatedChain(compile_dag(load_dag("grpo_kl" if kl else "grpo")), models)
    for step in range(2):
        samples = _samples(seed=step)
        if kl:  # the replaced code path: the reference step on the batch in hand, then the step
            samples_with_ref = reference_logprobs(reference, samples, 1.0)
            want = train_global_batch(direct, samples_with_ref, algo, MB_TOKENS, SCHEDULE, 1.0)
        else:
            want = train_global_batch(direct, samples, algo, MB_TOKENS, SCHEDULE, 1.0)
        got = chain.run(samples, GROUP, step)
        assert got == want and want["loss"] != 0.0
        assert _same_weights(direct, via_dag)


@pytest.mark.parametrize("kl", [False, True])
def test_ppo_dag_gives_the_losses_of_ppo_critic_step(model_dir, kl):
    algo = GRPOAlgorithm(estimator="gae", kl_coef=0.1 if kl else 0.0, kl_estimator="k1", kl_in="reward")
    actors = HFTrainEngine(tiny_llama(0), lr=1e-2), HFTrainEngine(tiny_llama(0), lr=1e-2)
    critics = CriticEngine(model_dir, lr=1e-2), CriticEngine(model_dir, lr=1e-2)
    reference = frozen_engine(model_dir, TrainerConfig(), 1.0) if kl else None
    models = ModelBindings(algo, MB_TOKENS, SCHEDULE, 1.0, actor=actors[1], reference=reference, critic=critics[1],
                           gae_gamma=0.9, gae_lambda=0.8)  # fmt: skip
    chain = ColocatedChain(compile_dag(load_dag("ppo_kl" if kl else "ppo")), models)
    for step in range(2):
        samples = _samples(seed=10 + step)
        batch = reference_logprobs(reference, samples, 1.0) if kl else samples
        want = train_global_batch(
            actors[0], batch, algo, MB_TOKENS, SCHEDULE, 1.0, critic=critics[0], gamma=0.9, lam=0.8
        )
        got = chain.run(samples, GROUP, step)
        assert got == want and want["value_loss"] > 0
        assert _same_weights(actors[0], actors[1])
    assert critics[0].values(samples) == critics[1].values(samples)


def test_the_two_reward_example_dag_changes_the_reward_the_update_sees():
    plan = compile_dag(load_dag(EXAMPLE_DAG))
    assert plan.order() == ["rollout", "length_penalty", "total_reward", "advantages", "train"]
    algo = GRPOAlgorithm()
    engines = HFTrainEngine(tiny_llama(0), lr=1e-2), HFTrainEngine(tiny_llama(0), lr=1e-2)
    samples = _samples()
    penalty = [-0.05 * max(0, len(s.response_ids) - 12) for s in samples]  # the example's options
    assert any(p < 0 for p in penalty)
    combined = [dataclasses.replace(s, reward=s.reward + p) for s, p in zip(samples, penalty, strict=True)]
    want = train_global_batch(engines[0], combined, algo, MB_TOKENS, SCHEDULE, 1.0)
    got = ColocatedChain(plan, ModelBindings(algo, MB_TOKENS, SCHEDULE, 1.0, actor=engines[1])).run(samples, GROUP)
    assert got.pop("total_reward_mean") == pytest.approx(sum(s.reward for s in combined) / len(combined))
    assert got == want and _same_weights(*engines)
    plain = train_global_batch(HFTrainEngine(tiny_llama(0), lr=1e-2), samples, algo, MB_TOKENS, SCHEDULE, 1.0)
    assert plain["loss"] != want["loss"]


def reference_logprobs(engine, samples, temperature):
    """``samples`` with the frozen reference's log-probs filled in."""
    ref = engine.logprobs(samples, temperature)
    return [dataclasses.replace(s, ref_logprobs=tuple(r)) for s, r in zip(samples, ref, strict=True)]
