"""HFTrainEngine on a tiny random Llama: log-probs, streamed accumulation, weights, save/load."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

from sluice.api.protocols import TrainEngine
from sluice.api.types import MicroBatch, Sample
from sluice.engines.hf_train import HFTrainEngine
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.losses.common import off_policy_metrics
from sluice.trainer.step import run_step
from tiny import VOCAB, tiny_llama

torch.set_num_threads(1)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(seed)


def make_samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        n_prompt, n_resp = rng.randint(2, 7), rng.randint(1, 9)
        samples.append(
            Sample(
                uid=f"s{i}",
                group_id=i // 3,
                prompt_ids=tuple(rng.randrange(1, VOCAB) for _ in range(n_prompt)),
                response_ids=tuple(rng.randrange(1, VOCAB) for _ in range(n_resp)),
                behav_logprobs=tuple(-rng.uniform(2.5, 4.0) for _ in range(n_resp)),
                token_versions=(0,) * n_resp,
                loss_mask=tuple(int(rng.random() < 0.85) for _ in range(n_resp)),
                reward=rng.choice([0.0, 1.0, 0.5]),
            )
        )
    return samples


def manual_logprobs(model: LlamaForCausalLM, s: Sample, temperature: float) -> list[float]:
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(s.prompt_ids)
    return [logp[start + j - 1, t].item() for j, t in enumerate(s.response_ids)]


def step_batches(engine: HFTrainEngine, samples: list[Sample], sizes: list[int]) -> list[MicroBatch]:
    """Micro-batches of the given sample counts, prox = current log-probs + noise."""
    rng = random.Random(7)
    prox = [[x + rng.uniform(-0.3, 0.3) for x in row] for row in engine.logprobs(samples, 1.0)]
    adv = GRPOAlgorithm().advantages(samples)
    normaliser = float(sum(sum(s.loss_mask) for s in samples))
    out, start = [], 0
    for size in sizes:
        idx = range(start, start + size)
        out.append(
            MicroBatch(
                samples=tuple(samples[i] for i in idx),
                advantages=tuple(tuple(adv[i]) for i in idx),
                prox_logprobs=tuple(tuple(prox[i]) for i in idx),
                normaliser=normaliser,
            )
        )
        start += size
    return out


def test_logprobs_match_manual_forward() -> None:
    model = tiny_model()
    engine = HFTrainEngine(model, lr=1e-3, forward_token_budget=24)
    assert isinstance(engine, TrainEngine)
    samples = make_samples(6)
    got = engine.logprobs(samples, temperature=0.7)
    for s, row in zip(samples, got, strict=True):
        assert row == pytest.approx(manual_logprobs(model, s, 0.7), abs=1e-5)


def test_streamed_accumulation_equals_full_batch() -> None:
    engine = HFTrainEngine(tiny_model(), lr=0.0, grad_clip=None)
    samples = make_samples(6, seed=1)
    algo = GRPOAlgorithm()
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    full = run_step(engine, step_batches(engine, samples, [6]), algo, normaliser=1.0)
    grads_full = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    streamed = run_step(engine, step_batches(engine, samples, [1, 3, 2]), algo, normaliser=1.0)
    for name, p in engine.model.named_parameters():
        assert torch.allclose(p.grad, grads_full[name], atol=1e-6), name
        assert torch.equal(p.detach(), before[name])  # lr = 0 keeps weights fixed
    assert streamed["loss"] == pytest.approx(full["loss"], abs=1e-6)
    assert streamed["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    assert streamed["clipped_tokens"] == full["clipped_tokens"] > 0
    assert streamed["tokens"] == full["tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert streamed["micro_batches"] == 3 and full["micro_batches"] == 1


def test_train_step_changes_weights_and_export_copies() -> None:
    engine = HFTrainEngine(tiny_model(), lr=1e-2)
    samples = make_samples(6, seed=2)
    w0 = engine.export_weights()
    assert w0["lm_head.weight"] is w0["model.embed_tokens.weight"]  # tied stays tied
    metrics = run_step(engine, step_batches(engine, samples, [2, 4]), GRPOAlgorithm(), normaliser=1.0)
    assert metrics["skipped_steps"] == 0.0 and metrics["grad_norm"] > 0
    w1 = engine.export_weights()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    w1["model.norm.weight"].add_(1.0)
    assert not torch.equal(w1["model.norm.weight"], engine.model.state_dict()["model.norm.weight"])


def test_save_load_roundtrip(tmp_path) -> None:
    samples = make_samples(6, seed=3)
    algo = GRPOAlgorithm()
    a = HFTrainEngine(tiny_model(), lr=1e-2)
    run_step(a, step_batches(a, samples, [3, 3]), algo, normaliser=1.0)
    saved = a.export_weights()
    a.save(str(tmp_path))
    b = HFTrainEngine(LlamaForCausalLM.from_pretrained(str(tmp_path)), lr=1e-2)
    b.load(str(tmp_path))
    for k, v in b.export_weights().items():
        assert torch.equal(v, saved[k]), k
    # Restored optimizer state: the next step is identical on both engines.
    batches = step_batches(a, samples, [6])
    run_step(a, batches, algo, normaliser=1.0)
    run_step(b, batches, algo, normaliser=1.0)
    wa, wb = a.export_weights(), b.export_weights()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k
    a.load(str(tmp_path))
    for k, v in a.export_weights().items():
        assert torch.equal(v, saved[k]), k


def test_the_cpu_update_runs_over_all_parameters_at_once_with_the_same_bits(tmp_path) -> None:
    """On CPU, AdamW and the gradient clip run torch's multi-tensor (``foreach``) kernels, also
    after a resume (the saved groups replace the engine's), and give the bits the default
    one-parameter-at-a-time update gives."""
    samples = make_samples(6, seed=4)
    fast, slow = HFTrainEngine(tiny_model(), lr=1e-2), HFTrainEngine(tiny_model(), lr=1e-2)
    slow.optimizer = torch.optim.AdamW(slow._params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, foreach=False)
    assert fast.optimizer.param_groups[0]["foreach"] is True
    for _ in range(2):
        batches = step_batches(fast, samples, [2, 4])
        norms = [run_step(e, batches, GRPOAlgorithm(), normaliser=1.0)["grad_norm"] for e in (fast, slow)]
        assert norms[0] == norms[1]
    for a, b in zip(fast.export_weights().values(), slow.export_weights().values(), strict=True):
        assert torch.equal(a, b)
    slow.save(str(tmp_path))
    fast.load(str(tmp_path))
    assert fast.optimizer.param_groups[0]["foreach"] is True


def test_the_log_prob_gap_is_measured_on_the_steps_first_micro_batch() -> None:
    """``logprob_gap_mean`` / ``_max``: |behaviour − trainer| log-probs over the first micro-batch's
    loss tokens, before the update (samples whose behaviour log-probs are the engine's own plus
    0.25 give 0.25; a later micro-batch's far larger gap does not count)."""
    import dataclasses

    engine = HFTrainEngine(tiny_model(), lr=1e-3)
    samples = make_samples(6)
    own = engine.logprobs(samples, 1.0)
    first = [dataclasses.replace(s, behav_logprobs=tuple(x + 0.25 for x in own[i])) for i, s in enumerate(samples[:3])]
    later = [
        dataclasses.replace(s, behav_logprobs=tuple(x - 5.0 for x in own[3 + i])) for i, s in enumerate(samples[3:])
    ]
    batches = step_batches(engine, first + later, [3, 3])
    metrics = run_step(engine, batches, GRPOAlgorithm(), 1.0)
    assert metrics["logprob_gap_mean"] == pytest.approx(0.25, abs=1e-4)
    assert metrics["logprob_gap_max"] == pytest.approx(0.25, abs=1e-4)


def test_entropy_is_logged_without_an_entropy_term() -> None:
    """``entropy`` (mean token entropy of the step's loss tokens) is a metric of every step, not
    only of runs with ``trainer.entropy_coef > 0``; with the term it is the same number."""
    samples = make_samples(6)
    plain = HFTrainEngine(tiny_model(), lr=1e-3)
    metrics = run_step(plain, step_batches(plain, samples, [3, 3]), GRPOAlgorithm(), 1.0)
    with_term = HFTrainEngine(tiny_model(), lr=1e-3)
    bonus = run_step(with_term, step_batches(with_term, samples, [3, 3]), GRPOAlgorithm(entropy_coef=0.01), 1.0)
    entropy = off_policy_metrics(metrics)["entropy"]  # as the trainer worker reports it
    assert entropy > 0
    assert entropy == pytest.approx(off_policy_metrics(bonus)["entropy"], rel=1e-5)


def test_a_resume_takes_the_configured_lr_and_schedule(tmp_path) -> None:
    """A checkpoint restores the optimizer's state, and with it the old rate; the loading engine's
    own ``lr`` and schedule apply from the checkpoint's update count on (a resume may change them)."""
    from sluice.engines.lr_schedule import LrSchedule

    samples = make_samples(6, seed=3)
    constant = HFTrainEngine(tiny_model(), lr=1e-2)
    for _ in range(2):
        run_step(constant, step_batches(constant, samples, [6]), GRPOAlgorithm(), normaliser=1.0)
    constant.save(str(tmp_path / "constant"))
    schedule = LrSchedule("linear", 1, 10)
    decayed = HFTrainEngine(tiny_model(), lr=1e-3, lr_schedule=schedule)
    decayed.load(str(tmp_path / "constant"))  # no scheduler file: AdamW's update count
    assert decayed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * schedule.factor(2))
    run_step(decayed, step_batches(decayed, samples, [6]), GRPOAlgorithm(), normaliser=1.0)
    assert decayed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * schedule.factor(3))
    decayed.save(str(tmp_path / "decayed"))
    again = HFTrainEngine(tiny_model(), lr=5e-4, lr_schedule=schedule)
    again.load(str(tmp_path / "decayed"))  # the scheduler's own count, the new peak rate
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 * schedule.factor(3))
    back = HFTrainEngine(tiny_model(), lr=2e-3)
    back.load(str(tmp_path / "decayed"))  # constant again
    assert back.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
