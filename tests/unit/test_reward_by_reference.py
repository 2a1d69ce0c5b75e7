"""Rewards by reference: ``reward.fn`` import paths from the CLI (sluice's and verl's calling
conventions, through a real reward process), ``reward.by_source`` routing, and the checks a run
makes at start (``RLTrainer.__init__`` → ``check_reward``)."""

import asyncio
import os
import pickle

import pytest

import fakes
from fakes import length_reward
from sluice import RLTrainer
from sluice.api import RewardFailure
from sluice.config import ConfigError, load_config
from sluice.rewards import ImportedReward, build_reward_service, check_reward


def _settle(service, cases):
    """Each case's score, or the ``RewardFailure`` it raised."""

    async def go():
        return await asyncio.gather(*(service(text, **fields) for text, fields in cases), return_exceptions=True)

    return asyncio.run(go())


def test_reward_fn_from_the_cli_runs_in_a_reward_process():
    """``sluice train reward.fn=fakes:tripled_length_reward``: a lambda, which pickle cannot ship by
    reference; the pool process imports it by path instead."""
    cfg = load_config(None, ["reward.fn=fakes:tripled_length_reward", "reward.pool_size=1"])
    assert cfg.reward.fn == "fakes:tripled_length_reward"
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(fakes.tripled_length_reward)
    service = build_reward_service(cfg.reward, default=length_reward)
    try:
        assert service.fn == ImportedReward("fakes:tripled_length_reward")
        assert _settle(service, [("abcd", {"answer": "x"}), ("abcdefgh", {})]) == [1.5, 3.0]
        (worker,) = service.pool._workers
        assert worker.process.pid != os.getpid() and worker.process.is_alive()
    finally:
        service.close()
    assert service.__name__ == "tripled_length_reward" and not service.failures


def test_verl_style_functions_get_verls_arguments():
    """A function with a ``solution_str`` parameter is called as verl calls ``compute_score``;
    its ``{"score": ...}`` dict scores ``score``."""
    cfg = load_config(None, ["reward.fn=fakes:verl_compute_score", "reward.pool_size=0"])
    service = build_reward_service(cfg.reward, default=None)
    cases = [
        ("42", {"answer": 42, "data_source": "gsm8k"}),
        ("41", {"answer": 42}),
        ("42", {"answer": "42", "extra_info": {"bonus": 0.5}}),  # verl's own extra_info
        ("42", {"answer": "42", "bonus": 0.25}),  # no extra_info: the other fields
    ]
    assert _settle(service, cases) == [1.0, 0.0, 1.5, 1.25]
    assert fakes.verl_compute_score("gsm8k", "1", "1")["source"] == "gsm8k"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_zz:score", r"reward\.fn: cannot import module 'no_such_module_zz'"),
        ("fakes:no_such_reward", r"reward\.fn: 'fakes' has no attribute 'no_such_reward'"),
        ("fakes:NOT_CALLABLE", r"reward\.fn: 'fakes:NOT_CALLABLE' is a int, not a callable"),
    ],
)
def test_a_bad_import_path_is_a_config_error_at_start(path, message):
    cfg = load_config(None, [f"reward.fn={path}"])
    with pytest.raises(ConfigError, match=message):
        check_reward(cfg.reward, None, max_new_tokens=64)
    with pytest.raises(ConfigError, match=message):
        build_reward_service(cfg.reward, default=None)
    with pytest.raises(ConfigError, match=message):
        RLTrainer(cfg)  # before any model, engine or worker


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("reward.fn=fakes.length_reward", r"reward\.fn: 'fakes\.length_reward' is not an import path"),
        ("reward.by_source.gsm8k=exact", r"reward\.by_source\.gsm8k: 'exact' is neither a built-in"),
        ("reward.format_pattern=(unclosed", r"reward\.format_pattern: not a regular expression"),
    ],
)
def test_malformed_references_fail_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_name_and_fn_exclude_each_other_and_the_python_reward():
    with pytest.raises(ConfigError, match=r"reward\.name .* and reward\.fn .* exclude each other"):
        load_config(None, ["reward.name=exact_match", "reward.fn=fakes:length_reward"])
    cfg = load_config(None, ["reward.by_source.a=exact_match"])
    with pytest.raises(ConfigError, match=r"reward\.by_source: set, and RLTrainer\(reward=\.\.\.\) given too"):
        RLTrainer(cfg, reward=length_reward)
    RLTrainer(load_config(None, []), reward=length_reward)  # the Python API alone still works


def test_by_source_routes_each_row_by_its_data_source():
    """Two sources, two rewards (a built-in and an import path), in a reward process; a source
    without an entry and no fallback is a counted failure naming the source, not a crash."""
    cfg = load_config(
        None,
        [
            "reward.by_source.exact=exact_match",
            "reward.by_source.length=fakes:tripled_length_reward",
            "reward.pool_size=1",
        ],
    )
    service = build_reward_service(cfg.reward, default=length_reward)  # the default is no fallback
    try:
        exact, wrong, long_, short, other = _settle(
            service,
            [
                ("42", {"answer": 42, "data_source": "exact"}),
                ("41", {"answer": 42, "data_source": "exact"}),
                ("41", {"answer": 42, "data_source": "length"}),
                ("abcd", {"answer": "x", "data_source": "length"}),
                ("42", {"answer": 42, "data_source": "other"}),
            ],
        )
    finally:
        service.close()
    assert (exact, wrong, long_, short) == (1.0, 0.0, 0.75, 1.5)
    assert isinstance(other, RewardFailure) and other.reason == "reward_error:by_source"
    assert "data_source 'other' has no entry in reward.by_source" in str(other)
    assert service.failures == {"reward_error:by_source": 1}


def test_by_source_falls_back_to_the_configured_reward():
    """Sources without an entry (and rows without a ``data_source``: ``default``) use ``reward.fn``."""
    cfg = load_config(
        None, ["reward.by_source.exact=exact_match", "reward.fn=fakes:length_reward", "reward.pool_size=0"]
    )
    service = build_reward_service(cfg.reward, default=None)
    cases = [
        ("abcd", {"answer": "abcd", "data_source": "exact"}),
        ("ab", {"answer": "x"}),
        ("ab", {"data_source": "z"}),
    ]
    assert _settle(service, cases) == [1.0, 0.25, 0.25]
