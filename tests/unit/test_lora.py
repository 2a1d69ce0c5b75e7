"""LoRA: only adapters train; a weight sync hands engines the merged weights, and the engine's
greedy log-probs then equal the trainer's (adapted) model's; save / load round-trips."""

from __future__ import annotations

import random

import pytest
import torch

from sluice.api.types import GenerationRequest, MicroBatch, Sample, SamplingParams
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.lora import LoraSpec
from sluice.trainer.algorithm import GRPOAlgorithm
from sluice.trainer.step import run_step
from tiny import VOCAB, tiny_llama

torch.set_num_threads(1)
SPEC = LoraSpec(rank=4, alpha=8.0)


def _step(engine: HFTrainEngine, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    samples = []
    for i in range(8):
        n = rng.randint(2, 6)
        response = tuple(rng.randrange(1, VOCAB) for _ in range(n))
        prompt = (1, rng.randrange(2, VOCAB))
        samples.append(Sample(f"s{i}", i // 4, prompt, response, (-3.0,) * n, (0,) * n, (1,) * n, float(i % 2)))
    algo = GRPOAlgorithm()
    adv = algo.advantages(samples)
    mb = MicroBatch(tuple(samples), tuple(map(tuple, adv)), tuple(s.behav_logprobs for s in samples), 1.0)
    return run_step(engine, [mb], algo, normaliser=1.0)


def _trained() -> HFTrainEngine:
    engine = HFTrainEngine(tiny_llama(0), lr=5e-2, lora=SPEC)
    for seed in range(3):
        _step(engine, seed)
    return engine


def _greedy(engine: HFInferenceEngine) -> list:
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    futures = [engine.submit(GenerationRequest(f"r{p}", (1, p, p + 1), params)) for p in (2, 5, 9, 14)]
    while engine.has_work():
        engine.step()
    return [f.result() for f in futures]


def _as_samples(completions: list) -> list[Sample]:
    return [Sample(c.request_id, 0, c.prompt_ids, c.token_ids, c.logprobs, c.versions, (1,) * len(c.token_ids), 0.0)
            for c in completions]  # fmt: skip


def test_only_adapters_train() -> None:
    engine = HFTrainEngine(tiny_llama(0), lr=5e-2, lora=SPEC)
    before = {k: v.clone() for k, v in engine.export_weights().items()}
    assert all(torch.equal(v, tiny_llama(0).state_dict()[k]) for k, v in before.items())  # B = 0 at the start
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    _step(engine, 0)
    _step(engine, 1)
    after = engine.export_weights()
    assert set(after) == set(before)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(k.split(".")[-2] in SPEC.target_modules for k in changed)  # only adapted weights move


def test_synced_engine_greedy_logprobs_equal_the_trainers_merged_model() -> None:
    trainer = _trained()
    engine = HFInferenceEngine(tiny_llama(0), max_batch=4)
    stale = _greedy(engine)
    engine.update_weights(trainer.export_weights(), version=1)
    completions = _greedy(engine)
    assert all(c.versions == (1,) * len(c.token_ids) for c in completions)
    want = trainer.logprobs(_as_samples(completions), temperature=0.0)  # through the adapters, unmerged
    for c, row in zip(completions, want, strict=True):
        assert list(c.logprobs) == pytest.approx(row, abs=1e-4)
    old = trainer.logprobs(_as_samples(stale), temperature=0.0)
    assert any(
        abs(a - b) > 1e-3 for c, row in zip(stale, old, strict=True) for a, b in zip(c.logprobs, row, strict=True)
    )


def test_save_writes_a_plain_merged_model_and_load_restores_adapters(tmp_path) -> None:
    trainer = _trained()
    trainer.save(str(tmp_path))
    plain = load_causal_lm(tmp_path)
    merged = trainer.export_weights()
    for name, value in plain.state_dict().items():
        assert torch.allclose(value, merged[name], atol=1e-6), name
    fresh = HFTrainEngine(tiny_llama(0), lr=5e-2, lora=SPEC)
    fresh.load(str(tmp_path))
    for name, value in fresh.export_weights().items():
        assert torch.equal(value, merged[name]), name
    _step(fresh, 7)
    _step(trainer, 7)
    after_trainer = trainer.export_weights()
    for name, value in fresh.export_weights().items():  # the optimizer state came back too
        assert torch.allclose(value, after_trainer[name], atol=1e-6), name
