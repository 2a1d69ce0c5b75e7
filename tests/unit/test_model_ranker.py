"""The learned length ranker (``fleet.length_ranker: model``): on lengths set by a rule over where
tokens sit in the prompt (its last token), not by its length, it learns the rule from finished
samples and ranks the long tail far better than the ridge ranker's bag of tokens."""

import random

import pytest
from harness.recall import top_share_recall

from sluice.rollout.length_ranker import OnlineLengthRanker
from sluice.rollout.model_ranker import SequenceLengthRanker


def _workload(count: int, seed: int) -> list[tuple[tuple[int, ...], int]]:
    """Prompts of 8-40 tokens; the response is long when the prompt ends with a token below 20, a fifth of them
    (an instruction at its end), whatever else the prompt holds."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        body = [rng.randrange(100) for _ in range(rng.randint(8, 40))]
        length = 200 if body[-1] < 20 else 20
        rows.append((tuple(body), round(length * rng.uniform(0.8, 1.2))))
    return rows


def test_the_model_ranker_learns_a_rule_the_ridge_ranker_cannot_see():
    train, held_out = _workload(768, seed=1), _workload(300, seed=2)
    model, ridge = SequenceLengthRanker(train_every=128, steps=25, background=False), OnlineLengthRanker()
    assert model.predict([p for p, _ in held_out[:3]]) == [0.0] * 3  # untrained: no ranking yet
    for prompt, length in train:
        model.observe(prompt, length)
        ridge.observe(prompt, length)
    assert model.trained_steps == 6 * 25
    actual = [n for _, n in held_out]
    prompts = [p for p, _ in held_out]
    model_recall = top_share_recall(model.predict(prompts), actual)
    ridge_recall = top_share_recall(ridge.predict(prompts), actual)
    assert model_recall >= 0.8 and model_recall > ridge_recall + 0.3, (model_recall, ridge_recall)


def test_bad_model_ranker_arguments_are_refused():
    with pytest.raises(ValueError, match="size"):
        SequenceLengthRanker(hidden=0)
    with pytest.raises(ValueError, match="negative"):
        SequenceLengthRanker().observe([1, 2], -1)


def test_a_run_trains_the_model_ranker_beside_the_loop_and_swaps_it_in_whole(monkeypatch):
    """A burst runs on the ranker's own thread while ``observe`` returns; predictions keep the
    old network until the burst swaps its trained copy in; a burst due while one runs is skipped
    and counted; a burst's error reaches the caller."""
    import threading

    model = SequenceLengthRanker(train_every=32, steps=5)
    release, threads = threading.Event(), []
    train = model._train

    def held(pairs):
        threads.append(threading.current_thread().name)
        release.wait(30)
        train(pairs)

    monkeypatch.setattr(model, "_train", held)
    rows = _workload(64, seed=3)
    before = model.net
    for prompt, length in rows:  # the first burst is due at 32 and held; the one due at 64 is skipped
        model.observe(prompt, length)
    assert model.net is before and model.trained_steps == 0 and model.skipped_bursts == 1
    release.set()
    model.wait()
    assert threads == ["length-ranker_0"] and model.trained_steps == 5 and model.net is not before
    assert len(set(model.predict([p for p, _ in rows[:8]]))) > 1  # the trained network ranks

    def broken(pairs):
        raise RuntimeError("burst failed")

    monkeypatch.setattr(model, "_train", broken)
    for prompt, length in rows[:32]:
        model.observe(prompt, length)
    with pytest.raises(RuntimeError, match="burst failed"):
        model.wait()
