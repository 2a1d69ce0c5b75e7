"""Output-length ranker, LPT order and skewness-aware dispatch (StreamRL)."""

import heapq
import random

import pytest
from harness.recall import top_share_recall
from harness.skew_plan import knee_batch, knee_step_time, replica_makespan, skewness_aware_dispatch

from sluice.api import LengthPredictor
from sluice.rollout.length_ranker import OnlineLengthRanker, long_tail, lpt_order


def _mean_length(ids):
    return 5 + len(ids) + 100 * ids.count(7) / len(ids)


def _prompt(rng):
    """Random prompts whose length depends on their length and, more, on how often token 7 occurs."""
    ids = [rng.randrange(10) for _ in range(rng.randint(2, 30))]
    return ids, max(1, round(_mean_length(ids) * rng.lognormvariate(0, 0.1)))


def test_ranker_learns_online_and_ranks_unseen_prompts():
    rng = random.Random(0)
    ranker = OnlineLengthRanker()
    assert isinstance(ranker, LengthPredictor)
    unseen = [_prompt(rng) for _ in range(400)]
    prompts, lengths = [p for p, _ in unseen], [n for _, n in unseen]
    untrained = top_share_recall(ranker.predict(prompts), lengths)
    for _ in range(1500):
        ranker.observe(*_prompt(rng))
    trained = top_share_recall(ranker.predict(prompts), lengths)
    oracle = top_share_recall([_mean_length(p) for p in prompts], lengths)  # the noise-free mean
    by_prompt_length = top_share_recall([len(p) for p in prompts], lengths)
    assert untrained < 0.35  # constant predictions: chance level (0.2)
    assert trained >= oracle - 0.05
    assert trained > by_prompt_length + 0.2  # it learned the token signal, not just the length


def test_forgetting_follows_drifting_lengths():
    ranker = OnlineLengthRanker(memory=200)
    prompt = [1, 2, 3]
    for _ in range(1000):
        ranker.observe(prompt, 10)
    assert ranker.predict([prompt])[0] == pytest.approx(10, rel=0.05)
    for _ in range(1000):
        ranker.observe(prompt, 40)
    assert ranker.predict([prompt])[0] == pytest.approx(40, rel=0.05)


def test_lpt_order_and_long_tail():
    assert lpt_order([3.0, 9.0, 1.0, 9.0]) == [1, 3, 0, 2]  # ties keep input order
    assert long_tail([3.0, 9.0, 1.0, 9.0, 5.0], share=0.2) == [1]
    assert long_tail([3.0, 9.0, 1.0, 9.0, 5.0], share=0.5) == [1, 3, 4]
    with pytest.raises(ValueError, match="share"):
        long_tail([1.0], share=0.0)


def test_top_share_recall_against_its_definition():
    actual = list(range(100))
    assert top_share_recall(actual, actual) == 1.0
    assert top_share_recall([-a for a in actual], actual) == 0.0
    constant = [sum(top_share_recall([0.0] * 100, actual, seed=s) for s in range(200)) / 200]
    assert constant[0] == pytest.approx(0.2, abs=0.03)


def _reference_makespan(lengths, cap, step_time):
    """Step-by-step continuous batching: one token per running sequence per iteration."""
    waiting, running, seconds = list(lengths), [], 0.0
    while waiting or running:
        while waiting and len(running) < cap:
            running.append(waiting.pop(0))
        seconds += step_time(len(running))
        running = [n - 1 for n in running if n > 1]
    return seconds


def test_replica_makespan_matches_step_by_step_batching():
    rng = random.Random(1)
    step_time = knee_step_time(0.01, knee=3)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        cap = rng.randint(1, 6)
        assert replica_makespan(lengths, cap, step_time) == pytest.approx(_reference_makespan(lengths, cap, step_time))


def test_lpt_admission_beats_a_long_request_admitted_last():
    step_time = knee_step_time(0.01, knee=4)
    lengths = [10.0] * 15 + [100.0]
    fifo = replica_makespan(lengths, 4, step_time)
    lpt = replica_makespan([lengths[i] for i in lpt_order(lengths)], 4, step_time)
    assert lpt < fifo


def test_knee_batch():
    assert knee_batch(knee_step_time(0.01, knee=8), max_batch=64) == 8
    assert knee_batch(lambda running: 0.01, max_batch=64) == 64


def _plain_lpt_makespan(predicted, replicas, cap, step_time):
    load = [(0.0, r) for r in range(replicas)]
    queues = [[] for _ in range(replicas)]
    for i in lpt_order(predicted):
        work, r = heapq.heappop(load)
        queues[r].append(predicted[i])
        heapq.heappush(load, (work + predicted[i], r))
    return max(replica_makespan(q, cap, step_time) for q in queues)


def test_skewness_aware_dispatch_isolates_the_long_tail_and_beats_plain_lpt():
    rng = random.Random(2)
    predicted = [float(rng.randint(5, 15)) for _ in range(600)] + [float(rng.randint(150, 250)) for _ in range(60)]
    rng.shuffle(predicted)
    step_time = knee_step_time(0.01, knee=16)
    plan = skewness_aware_dispatch(predicted, 4, step_time, max_batch=64)
    plain = _plain_lpt_makespan(predicted, 4, 64, step_time)
    assert plan.tail_replicas  # a split paid off here
    assert plan.predicted_makespan < 0.95 * plain
    on_tail = {i for r in plan.tail_replicas for i in plan.order[r]}
    assert on_tail == set(long_tail(predicted, 0.2))
    assert all(plan.max_batch[r] < 64 for r in plan.tail_replicas)  # smaller batches for the long tail
    assert all(plan.max_batch[r] == 64 for r in range(4) if r not in plan.tail_replicas)
    assert sorted(i for queue in plan.order for i in queue) == list(range(660))  # each request exactly once
    for r, queue in enumerate(plan.order):
        assert all(plan.replica_of[i] == r for i in queue)
        assert [predicted[i] for i in queue] == sorted((predicted[i] for i in queue), reverse=True)


def test_dispatch_never_predicts_worse_than_plain_lpt():
    rng = random.Random(3)
    for _ in range(20):
        predicted = [rng.lognormvariate(3, 1) for _ in range(rng.randint(1, 80))]
        replicas, cap = rng.randint(1, 5), rng.randint(2, 32)
        step_time = knee_step_time(0.01, knee=rng.randint(1, cap))
        plan = skewness_aware_dispatch(predicted, replicas, step_time, max_batch=cap)
        assert plan.predicted_makespan <= _plain_lpt_makespan(predicted, replicas, cap, step_time) + 1e-9
        if replicas == 1:
            assert plan.tail_replicas == ()
