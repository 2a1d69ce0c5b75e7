"""KL-to-reference estimators, the KL / entropy terms and the reference step, against plain
Python references (per-token value and d loss / d logp, then the aggregation)."""

from __future__ import annotations

import dataclasses
import math
import random
import threading

import pytest
import torch

from loss_cases import run_loss
from sluice.api import Sample
from sluice.api.types import LossInputs, LossOutputs
from sluice.config import TrainerConfig
from sluice.dag.node_worker import NodeTaskWorker
from sluice.dag.spec import load_dag
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.response_tokens import token_entropy
from sluice.queue import LocalQueue
from sluice.queue.samples import REF_COLUMN, rows_to_samples, samples_to_rows, train_columns
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.losses.regularizers import add_regularizers, kl_estimate, sequence_kl
from sluice.trainer.worker import TRAIN_TASK
from tiny import tiny_llama

torch.set_num_threads(1)


def ref_kl(logp: float, ref: float, estimator: str) -> tuple[float, float]:
    """(KL estimate, d estimate / d logp) of one token, δ = ref − logp."""
    d = ref - logp
    if estimator == "k1":
        return -d, 1.0
    if estimator == "k2":
        return 0.5 * d * d, -d
    return math.exp(d) - 1 - d, -math.exp(d) + 1


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    lengths = [3, 1, 6, 4]
    n = sum(lengths)
    logp = [rng.uniform(-3, -0.1) for _ in range(n)]
    return {
        "logp": logp,
        "prox": logp,
        "behav": logp,
        "adv": [0.0] * n,  # the policy term is 0: what remains is the regularizer
        "mask": [rng.random() < 0.75 for _ in range(n)],
        "ref": [x + rng.uniform(-0.8, 0.8) for x in logp],
        "entropy": [rng.uniform(0.1, 2.0) for _ in range(n)],
        "lengths": lengths,
    }


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_the_formulas(estimator):
    d = _case(0)
    logp = torch.tensor(d["logp"], dtype=torch.float64, requires_grad=True)
    kl = kl_estimate(logp, torch.tensor(d["ref"], dtype=torch.float64), estimator)
    kl.sum().backward()
    for k, (lp, rf) in enumerate(zip(d["logp"], d["ref"], strict=True)):
        value, grad = ref_kl(lp, rf, estimator)
        assert kl[k].item() == pytest.approx(value, abs=1e-12)
        assert logp.grad[k].item() == pytest.approx(grad, abs=1e-12)
    if estimator != "k1":
        assert (kl >= 0).all()
    mask = [int(m) for m in d["mask"]]
    want = sum(ref_kl(lp, rf, estimator)[0] * m for lp, rf, m in zip(d["logp"], d["ref"], mask, strict=True))
    assert sequence_kl(d["logp"], d["ref"], mask, estimator) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_kl_and_entropy_terms_add_to_the_loss(agg):
    d, beta, alpha, normaliser = _case(1), 0.3, 0.05, 7.0

    def with_terms(inputs: LossInputs, **_) -> LossOutputs:
        ref = torch.tensor(d["ref"], dtype=torch.float64)
        # entropy values from the case, with d entropy / d logp = entropy (a stand-in graph)
        entropy = torch.tensor(d["entropy"], dtype=torch.float64) * torch.exp(inputs.logp - inputs.logp.detach())
        inputs = dataclasses.replace(inputs, ref_logp=ref, entropy=entropy)
        zero = LossOutputs(loss=inputs.logp.sum() * 0.0, stats={})
        return add_regularizers(zero, inputs, agg, beta, "k3", alpha)

    out, grad = run_loss(with_terms, d, normaliser)
    loss, want_grad, start = 0.0, [0.0] * len(d["logp"]), 0
    for n in d["lengths"]:
        toks = [t for t in range(start, start + n) if d["mask"][t]]
        div = max(len(toks), 1) if agg == "seq-mean-token-mean" else 1
        for t in toks:
            kl, dkl = ref_kl(d["logp"][t], d["ref"][t], "k3")
            loss += (beta * kl - alpha * d["entropy"][t]) / div / normaliser
            want_grad[t] = (beta * dkl - alpha * d["entropy"][t]) / div / normaliser
        start += n
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    assert out.stats["entropy_sum"] == pytest.approx(sum(e for e, m in zip(d["entropy"], d["mask"], strict=True) if m))


def test_zero_coefficients_change_nothing_and_missing_inputs_are_named():
    d = _case(2)
    inputs = LossInputs(torch.tensor(d["logp"]), torch.tensor(d["logp"]), torch.tensor(d["logp"]),
                        torch.zeros(len(d["logp"])), torch.tensor(d["mask"]), 1.0)  # fmt: skip
    out = LossOutputs(loss=torch.tensor(1.5), stats={"tokens": 3.0})
    assert add_regularizers(out, inputs, "token-mean", 0.0, "k3", 0.0) is out
    with pytest.raises(ValueError, match="ref_logp"):
        add_regularizers(out, inputs, "token-mean", 0.1, "k3", 0.0)
    with pytest.raises(ValueError, match="entropy"):
        add_regularizers(out, inputs, "token-mean", 0.0, "k3", 0.1)


def test_token_entropy_is_the_distribution_entropy():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    probs = torch.softmax(logits, -1).tolist()
    want = [-sum(p * math.log(p) for p in row) for row in probs]
    assert token_entropy(torch.log_softmax(logits, -1)).tolist() == pytest.approx(want, abs=1e-12)


def _sample(uid: str, group: int, reward: float, behav: tuple, ref: tuple = (), mask: tuple | None = None) -> Sample:
    n = len(behav)
    return Sample(uid, group, (1, 2), tuple(range(3, 3 + n)), behav, (0,) * n, mask or (1,) * n, reward,
                  ref_logprobs=ref)  # fmt: skip


def test_kl_in_the_reward_is_subtracted_before_the_group_baseline():
    samples = [
        _sample("a", 0, 1.0, (-1.0, -2.0), (-1.5, -1.0)),
        _sample("b", 0, 0.0, (-0.5,), (-0.5,)),
        _sample("c", 0, 1.0, (-1.0, -1.0, -3.0), (-2.0, -1.0, -1.0), mask=(1, 1, 0)),
    ]
    algo = GRPOAlgorithm(estimator="dr_grpo", kl_coef=0.5, kl_estimator="k1", kl_in="reward")
    # k1 = behav − ref summed over loss tokens: a: 0.5 − 1.0 = −0.5, b: 0, c: 1.0 (masked token ignored)
    rewards = [1.0 + 0.25, 0.0, 1.0 - 0.5]
    mean = sum(rewards) / 3
    assert [row[0] for row in algo.advantages(samples)] == pytest.approx([r - mean for r in rewards], abs=1e-12)
    in_loss = GRPOAlgorithm(estimator="dr_grpo", kl_coef=0.5, kl_in="loss")
    assert [row[0] for row in in_loss.advantages(samples)] == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    with pytest.raises(ValueError, match="reference log-probs"):
        algo.advantages([_sample("d", 1, 1.0, (-1.0,))])


def test_engine_fills_reference_logprobs_and_entropies():
    model = tiny_llama(0)
    engine = HFTrainEngine(model, lr=0.0)
    s = Sample("x", 0, (1, 5, 7), (4, 9, 2), (-3.0,) * 3, (0,) * 3, (1,) * 3, 1.0, ref_logprobs=(-1.0, -2.0, -3.0))
    from sluice.api.types import MicroBatch

    mb = MicroBatch((s,), ((1.0,) * 3,), (s.behav_logprobs,), 3.0)
    inputs = engine._loss_inputs(mb, [[0]], with_entropy=True)
    assert inputs.ref_logp.tolist() == [-1.0, -2.0, -3.0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0, 2:5]
    assert inputs.entropy.tolist() == pytest.approx(token_entropy(torch.log_softmax(logits, -1)).tolist(), abs=1e-5)
    assert inputs.entropy.requires_grad
    metric_only = engine._loss_inputs(mb, [[0]]).entropy  # without an entropy term: for the metric, no graph
    assert metric_only is not None and not metric_only.requires_grad
    assert metric_only.tolist() == pytest.approx(inputs.entropy.tolist())


def test_reference_worker_writes_the_column_the_trainer_waits_for(tmp_path):
    tiny_llama(3).save_pretrained(tmp_path)
    rng = random.Random(0)
    groups = [[_sample(f"{g}-{k}", g, 1.0, tuple(-rng.random() for _ in range(rng.randint(1, 6)))) for k in range(2)]
              for g in range(3)]  # fmt: skip
    queue = LocalQueue()
    queue.register_task(TRAIN_TASK, train_columns(True))
    node = next(n for n in load_dag("grpo_kl").nodes if n.function == "reference_logprobs")
    queue.register_task(node.id, node.reads)
    for group in groups:
        queue.put(*samples_to_rows(group, 2))
    assert len(queue.get(TRAIN_TASK, train_columns(True), 6, timeout=0)) == 0  # waits for the reference step
    worker = NodeTaskWorker(node, queue, model_dir=tmp_path, trainer=TrainerConfig(lr=1.0), batch_rows=4)
    thread = threading.Thread(target=worker.serve)
    thread.start()
    batch = queue.get(TRAIN_TASK, train_columns(True), 6, timeout=30)
    queue.close()
    thread.join(timeout=30)
    samples = rows_to_samples(batch)
    want = HFTrainEngine(tiny_llama(3), lr=0.0).logprobs(samples, 1.0)
    assert worker.rows_done == 6 and REF_COLUMN in batch.columns
    for s, row in zip(samples, want, strict=True):
        assert s.ref_logprobs == pytest.approx(row, abs=1e-5)
    assert all(not p.requires_grad for p in worker.context.models.reference.model.parameters())
