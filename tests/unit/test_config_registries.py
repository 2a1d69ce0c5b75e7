"""The config's ``Literal`` choices and the registries that serve them name the same things: a
choice the config accepts always has an implementation, and an implementation is always reachable
from the config."""

from typing import get_args

from sluice.config.models import RolloutConfig
from sluice.config.services import BUILTIN_REWARDS, RewardConfig
from sluice.config.trainer import TrainerConfig
from sluice.engines import INFERENCE_ENGINES
from sluice.rewards import REWARDS
from sluice.trainer.algos import ADVANTAGE_ESTIMATORS
from sluice.trainer.losses import AGG_MODES, POLICY_LOSSES
from sluice.trainer.losses.regularizers import KL_ESTIMATORS


def _choices(model: type, field: str) -> set[str]:
    annotation = model.model_fields[field].annotation  # type: ignore[attr-defined]
    return {a for a in get_args(annotation) if isinstance(a, str)} | {
        b for a in get_args(annotation) for b in get_args(a) if isinstance(b, str)
    }


def test_engines_rewards_and_losses_of_the_config_are_the_registries() -> None:
    assert _choices(RolloutConfig, "engine") == set(INFERENCE_ENGINES)
    assert _choices(RewardConfig, "name") == set(REWARDS) == set(BUILTIN_REWARDS)
    assert _choices(TrainerConfig, "policy_loss") == set(POLICY_LOSSES)
    assert _choices(TrainerConfig, "loss_agg_mode") == set(AGG_MODES)
    assert _choices(TrainerConfig, "kl_estimator") == set(KL_ESTIMATORS)


def test_every_algorithm_has_its_advantage_estimator() -> None:
    """``ppo`` estimates with ``gae`` over a critic's values; every other algorithm by its name."""
    algorithms = _choices(TrainerConfig, "algorithm")
    assert {"gae" if a == "ppo" else a for a in algorithms} == set(ADVANTAGE_ESTIMATORS)
