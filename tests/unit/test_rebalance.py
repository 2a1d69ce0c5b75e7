"""Dynamic rebalancing: the add / remove rule, and the control loop on simulated replicas
reacting to an injected length shift through the real LLMProxy."""

from __future__ import annotations

import pytest
from harness.rebalance_run import run_with_shift

from sluice.schedule.rebalance import Rebalancer, RebalanceRule, decide
from sluice.sim.cost_model import TrainerCost
from sluice.sim.engine import LengthModel, SimEngineConfig
from sluice.sim.simulate import SimConfig

RULE = RebalanceRule(min_replicas=1, max_replicas=4)


@pytest.mark.parametrize(
    ("step_s", "generation_s", "train_s", "replicas", "change"),
    [
        # the step waited for generation (10 s > 4 s of training): its 10 s spread over one more
        # replica give max(10 * 2/3, 4) = 6.7 s, a cut of 33 % >= a quarter share (1/12); a fourth
        # gives 5 s, a cut of 25 % of 6.7 s >= 1/16: add both in one decision (the maximum is 4)
        (10.0, 10.0, 4.0, 2, 2),
        # with one more: max(6.7, 9.5) = 9.5, a cut of 5 % < 1/12: too little for a replica
        (10.0, 10.0, 9.5, 2, 0),
        # ... but 9.0 leaves a cut of 10 %: add
        (10.0, 10.0, 9.0, 2, 1),
        (10.0, 10.0, 4.0, 4, 0),  # at the maximum
        # the step hardly waited (4.2 s vs 4 s of training): one more predicts 4 s, a cut of 5 %
        (4.2, 4.0, 4.0, 2, 0),
        (8.0, 2.0, 8.0, 2, -1),  # one fewer: max(2 * 2/1, 8) = 8, the step stays 8: remove
        (8.0, 5.0, 8.0, 2, 0),  # one fewer: 10 > 8, the step would grow
        # one fewer: 7.6 s of generation beside 8 s of training, the step stays 8 s, but the
        # replicas' work would leave training less than a quarter share (1/8) of slack: keep it
        (8.0, 3.8, 8.0, 2, 0),
        (8.0, 2.0, 8.0, 1, 0),  # at the minimum
        # the step waited (12 s) with the replicas busy 2 s: the wait counts as generation's
        # (a tail included), so one more is predicted to cut it to 8 s; whether it did is judged
        # after the cooldown (test_rebalancer_waits_out_its_cooldown_and_stops_adding...)
        (12.0, 2.0, 8.0, 2, 1),
        # the same wait with the replicas at the maximum: one fewer adds no work beyond training
        # (max(2.7, 8)), the rest of the step stays: remove
        (12.0, 2.0, 8.0, 4, -1),
    ],
)
def test_decide(step_s, generation_s, train_s, replicas, change):
    assert decide(step_s, generation_s, train_s, replicas, RULE) == change


def test_decide_in_sync_adds_generation_and_training():
    """Without overlap a step generates then trains: one fewer replica lengthens it by the added
    generation where the overlapped model hides that generation behind training."""
    sync = RebalanceRule(max_replicas=4, overlapped=False)
    assert decide(7.2, 3.0, 7.0, 2, RULE) == -1  # max(6, 7) = max(3, 7): the step stays
    assert decide(7.2, 3.0, 7.0, 2, sync) == 0  # 3 + 7 -> 6 + 7: 3 s longer
    assert decide(10.0, 3.0, 7.0, 2, sync) == 1  # 3 + 7 -> 2 + 7: a cut of 10 % >= 1/12


def test_the_planner_bound_and_the_rule_share_one_step_model():
    from sluice.schedule.step_model import generation_span_s, predicted_step_s, step_time_s

    assert step_time_s(6.0, 7.0, 3.0, overlapped=True) == 7.0
    assert step_time_s(6.0, 7.0, 3.0, overlapped=False) == 13.0
    assert step_time_s(2.0, 7.0, 3.0, overlapped=False) == 10.0  # the tail, then training
    assert generation_span_s(12.0, 2.0, 8.0, overlapped=True) == 12.0  # the trainer waited: generation set it
    assert generation_span_s(8.0, 2.0, 8.0, overlapped=True) == 2.0  # it did not: the replicas' busy time
    assert generation_span_s(12.0, 2.0, 8.0, overlapped=False) == 4.0  # in sequence: the step less training
    assert predicted_step_s(10.0, 10.0, 4.0, 2, 4, overlapped=True) == 5.0  # 10 s over twice the replicas
    assert predicted_step_s(12.0, 2.0, 8.0, 2, 3, overlapped=True) == 8.0  # training is the floor
    assert predicted_step_s(12.0, 2.0, 8.0, 2, 1, overlapped=True) == 12.0  # fewer: the rest of the step stays
    assert predicted_step_s(12.0, 5.0, 8.0, 2, 1, overlapped=True) == 14.0  # 5 s -> 10 s of work: +2 s


def test_bad_rebalance_config_is_refused():
    with pytest.raises(ValueError, match="min_replicas"):
        RebalanceRule(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="cooldown"):
        RebalanceRule(window=3, cooldown=1)


ENGINE = SimEngineConfig(decode_s=0.02, knee=16, max_running=64, prefill_s_per_token=1e-4, load_s=0.5,
                         lengths=LengthModel(40, 0.3, 0.3))  # fmt: skip
CONFIG = SimConfig(
    ENGINE, TrainerCost(token_s=2e-4, microbatch_overhead_s=0.05, micro_batch_tokens=1024, step_s=5.0),
    replicas=2, prompts_per_step=16, group_size=8, max_new_tokens=1000, prompt_len=16, steps=16, eta=1,
)  # fmt: skip


def test_rebalancer_adds_replicas_after_a_length_shift_and_the_step_recovers():
    longer = LengthModel(160, 0.3, 0.3)
    fixed = run_with_shift(CONFIG, shift_at=6, lengths=longer, rebalance=None)
    balanced = run_with_shift(CONFIG, shift_at=6, lengths=longer, rebalance=RULE)
    assert [r.replicas for r in fixed.rows] == [2] * 16
    adds = [e for e in balanced.events if e.change > 0]
    assert adds and all(e.step > 6 for e in adds)  # nothing before the shift made generation lag
    assert balanced.rows[-1].replicas > 2
    late = slice(11, 16)
    mean = lambda rows: sum(r.step_s for r in rows[late]) / 5  # noqa: E731
    assert mean(balanced.rows) < 0.85 * mean(fixed.rows)
    # the added replicas took requests and got the newest weights
    assert balanced.result.counters["groups_trained"] == 16 * 16
    assert max(balanced.result.staleness) <= 1


def test_rebalancer_waits_out_its_cooldown_and_stops_adding_when_it_does_not_pay():
    rebalancer = Rebalancer(RebalanceRule(window=1, cooldown=1))
    steps = [  # (step_s, generation_s, train_s) and the replicas that ran the step
        (10.0, 10.0, 4.0, 2),  # generation lags: add three (5 replicas: max(10 * 2/5, 4) = 4 s predicted)
        (10.0, 9.0, 4.0, 5),  # cooldown
        (9.5, 9.0, 4.0, 5),  # the adds cut the step by 5 % < 3/5 of a quarter, their threshold: adding stops
        (9.5, 9.0, 4.0, 5),  # so no more adds (the model alone would add)
        (20.0, 18.0, 4.0, 5),  # generation grew by more than a replica's share (> 10.8): adding resumes, to 8
        (4.0, 1.0, 8.0, 8),  # cooldown
        (8.0, 1.0, 8.0, 8),  # training lags: remove one
    ]
    changes = [rebalancer.observe(k, *row) for k, row in enumerate(steps, 1)]
    assert changes == [3, 0, 0, 0, 3, 0, -1]
    assert [(e.step, e.change, e.replicas) for e in rebalancer.events] == [(1, 3, 5), (3, 0, 5), (5, 3, 8), (7, -1, 7)]
    assert "generation lags" in rebalancer.events[0].reason and "3 more" in rebalancer.events[0].reason
    assert "waits for nothing" in rebalancer.events[-1].reason


def test_rebalancer_averages_its_window():
    """Removing judges the window's mean; adding also the newest step alone (a step that grew is news)."""
    rebalancer = Rebalancer(RebalanceRule(window=2, cooldown=2))
    assert decide(8.0, 2.0, 8.0, 2, RULE) == -1  # alone this step would remove one ...
    assert rebalancer.observe(1, 8.0, 2.0, 8.0, 2) == 0  # ... but the rule waits for a full window
    assert decide(8.0, 4.6, 8.0, 2, RULE) == 0  # this one alone would keep both ...
    assert rebalancer.observe(2, 8.0, 4.6, 8.0, 2) == -1  # ... the mean (8, 3.3, 8) leaves room: remove
    growing = Rebalancer(RebalanceRule(window=2, cooldown=2))
    assert growing.observe(1, 4.0, 1.0, 4.0, 2) == 0
    assert decide(12.0, 10.0, 4.0, 2, growing.rule) == 4  # the window's mean asks for 6 replicas ...
    assert growing.observe(2, 20.0, 19.0, 4.0, 2) == 6  # ... the newest step alone for 8: it wins
    assert (growing.events[0].step_s, growing.events[0].predicted_s) == (20.0, 5.0)  # 20 s over 8 replicas


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.controller=multi", "run.backend=ray"], r"fleet\.rebalance needs run\.controller: single"),
        (
            ["fleet.rebalance_window=3"],
            r"fleet\.rebalance_cooldown \(2\) must be at least fleet\.rebalance_window \(3\)",
        ),
        (["resources.rollout.replicas=2", "resources.rollout.max_replicas=1"], r"replicas \(2\) <= max_replicas \(1\)"),
        (["resources.rollout.min_replicas=2"], r"min_replicas \(2\) <= replicas \(1\)"),
        (["fleet.weight_transfer=broadcast", "run.backend=ray"], r"a broadcast group's ranks are fixed"),
    ],
)
def test_rebalance_options_a_run_cannot_honour_are_refused(overrides, message):
    from sluice.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["fleet.rebalance=true", *overrides])


def test_a_runs_rule_comes_from_its_config():
    from sluice.config import load_config
    from sluice.controller.rebalancing import rebalance_rule

    config = load_config(None, ["fleet.rebalance=true", "resources.rollout.replicas=2", "fleet.rebalance_cooldown=3"])
    assert rebalance_rule(config) == RebalanceRule(min_replicas=1, max_replicas=2, window=2, cooldown=3)
    config = load_config(None, ["resources.rollout.max_replicas=4", "run.mode=sync"])
    assert rebalance_rule(config).max_replicas == 4 and not rebalance_rule(config).overlapped


def test_the_removed_margin_key_is_refused_with_why():
    from sluice.config import ConfigError, load_config

    removed = r"fleet\.rebalance_margin: unknown key \(fleet\.rebalance_margin was removed"
    with pytest.raises(ConfigError, match=removed):
        load_config(None, ["fleet.rebalance=true", "fleet.rebalance_margin=0.2"])
