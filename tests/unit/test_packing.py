"""Packed rows with shared prompts: same log-probs as one sequence at a time, no cross-sequence
attention, deterministic chunking within the budget."""

import random
from dataclasses import replace

import pytest
import torch

from sluice.api.types import Sample
from sluice.engines.packing import family_tokens, pack_batch, packed_chunks, prompt_families
from sluice.engines.padding import pad_batch
from tiny import tiny_llama


def _samples(seed: int, groups: int = 4, group_size: int = 3) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(1, 32) for _ in range(rng.randint(1, 7)))
        for k in range(group_size):
            resp = tuple(rng.randrange(1, 32) for _ in range(rng.randint(0 if k == 1 else 1, 9)))
            out.append(Sample(f"{g}-{k}", g, prompt, resp, (0.0,) * len(resp), (0,) * len(resp), (1,) * len(resp), 0.0))
    return out


def _logprobs(model, batch):
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch.get("position_ids"),
        use_cache=False,
    ).logits
    picked = torch.log_softmax(logits[batch["logit_rows"], batch["logit_cols"]], dim=-1)
    return picked.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("row_tokens", [0, 40, 1000])
def test_packed_logprobs_equal_one_sequence_at_a_time(share_prompts, row_tokens):
    model = tiny_llama()
    samples = _samples(seed=row_tokens)
    with torch.no_grad():
        alone = torch.cat([_logprobs(model, pad_batch([s])) for s in samples])
        for rows in packed_chunks(samples, budget=10_000, row_tokens=row_tokens, share_prompts=share_prompts):
            order = [i for row in rows for i in row]
            packed = _logprobs(model, pack_batch([[samples[i] for i in row] for row in rows], share_prompts))
            expected = torch.cat([_slice(alone, samples, i) for i in order])
            torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)


def _slice(flat, samples, i):
    start = sum(len(s.response_ids) for s in samples[:i])
    return flat[start : start + len(samples[i].response_ids)]


def test_no_token_attends_to_another_sequence():
    """Changing one response never changes another's log-probs inside the same packed row."""
    model = tiny_llama()
    samples = _samples(seed=3, groups=2)
    rows = [samples]  # everything in one row: two families, three responses each
    with torch.no_grad():
        before = _logprobs(model, pack_batch(rows))
        edited = list(samples)
        s = edited[2]
        edited[2] = Sample(s.uid, s.group_id, s.prompt_ids, tuple(31 - t for t in s.response_ids),
                           s.behav_logprobs, s.token_versions, s.loss_mask, 0.0)  # fmt: skip
        after = _logprobs(model, pack_batch([edited]))
    mine = sum(len(x.response_ids) for x in samples[:2]), sum(len(x.response_ids) for x in samples[:3])
    torch.testing.assert_close(before[: mine[0]], after[: mine[0]], atol=0, rtol=0)
    torch.testing.assert_close(before[mine[1] :], after[mine[1] :], atol=0, rtol=0)
    assert not torch.equal(before[mine[0] : mine[1]], after[mine[0] : mine[1]])


def test_families_share_one_prompt_copy():
    samples = _samples(seed=1, groups=3, group_size=4)
    assert prompt_families(samples) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert prompt_families(samples, share_prompts=False) == [[i] for i in range(12)]
    batch = pack_batch([samples[:4]])
    assert batch["input_ids"].shape[1] == family_tokens(samples, [0, 1, 2, 3])
    assert batch["input_ids"].shape[1] == len(samples[0].prompt_ids) + sum(len(s.response_ids) for s in samples[:4])


def test_chunks_cover_every_sample_once_within_budget():
    samples = _samples(seed=7, groups=20, group_size=4)
    for row_tokens in (0, 64):
        chunks = packed_chunks(samples, budget=96, row_tokens=row_tokens)
        assert sorted(i for rows in chunks for row in rows for i in row) == list(range(len(samples)))
        for rows in chunks:
            width = pack_batch([[samples[i] for i in row] for row in rows])["input_ids"].shape[1]
            assert len(rows) == 1 or len(rows) * width <= 96
        assert chunks == packed_chunks(samples, budget=96, row_tokens=row_tokens)
    assert max(len(rows[0]) for rows in packed_chunks(samples, budget=96, row_tokens=64)) > 4  # rows hold >1 group


def test_train_engine_layouts_give_the_same_gradients():
    """One micro-batch through ``HFTrainEngine`` packed (shared prompts) and padded: same loss
    and gradients to float rounding."""
    from sluice.api.types import MicroBatch
    from sluice.engines.hf_train import HFTrainEngine
    from sluice.trainer.algorithm import GRPOAlgorithm

    rewards = iter([0.0, 1.0, 1.0, 0.0, 0.5] * 4)
    samples = [replace(s, reward=next(rewards)) for s in _samples(seed=11, groups=5, group_size=4)]
    algorithm = GRPOAlgorithm()
    advantages = algorithm.advantages(samples)
    mb = MicroBatch(tuple(samples), tuple(map(tuple, advantages)), tuple(s.behav_logprobs for s in samples), 10.0)
    grads, losses = [], []
    for layout in ("padded", "packed"):
        engine = HFTrainEngine(tiny_llama(), lr=1e-3, layout=layout, padded_token_budget=64)
        engine.begin_step()
        engine.accumulate(mb, algorithm)
        losses.append(engine._totals["loss"])
        grads.append(torch.cat([p.grad.flatten() for p in engine.model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    assert grads[0].abs().sum() > 0
