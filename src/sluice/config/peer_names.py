"""The names verl, TRL and OpenRLHF users type for sluice's options: an unknown key one of them
uses is answered with the sluice key, a key sluice removed with why (``REMOVED_KEYS``), and any
other unknown key with the closest allowed names.

``PEER_NAMES`` is the one table (the README's "Coming from verl or TRL" table is tested against
it); ``suggest(key, allowed)`` is what ``loading.py`` appends to an unknown-key error. It does not
translate anything: a config names sluice's keys, the message only says which.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

PEER_NAMES: dict[str, str] = {
    # verl
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.rollout.n": "rollout.group_size",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.actor.optim.lr": "trainer.lr",
    "actor_rollout_ref.actor.ppo_epochs": "trainer.ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size": (
        "trainer.ppo_mini_batches (a count: train_batch_size / ppo_mini_batch_size)"
    ),
    "actor_rollout_ref.actor.clip_ratio_low": "trainer.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "trainer.clip_high",
    "actor_rollout_ref.actor.loss_agg_mode": "trainer.loss_agg_mode",
    "actor_rollout_ref.actor.kl_loss_coef": "trainer.kl_coef",
    "actor_rollout_ref.actor.kl_loss_type": "trainer.kl_estimator (low_var_kl is k3)",
    "actor_rollout_ref.actor.entropy_coeff": "trainer.entropy_coef",
    "algorithm.adv_estimator": "trainer.algorithm",
    "algorithm.use_kl_in_reward": "trainer.kl_in: reward",
    "data.train_batch_size": "rollout.prompts_per_step",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.filter_overlong_prompts": "data.long_prompts",
    "custom_reward_function.path": "reward.fn: path/to/file.py:function or module:function",
    "custom_reward_function.name": "reward.fn: path/to/file.py:function or module:function",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_penalty",
    "trainer.total_training_steps": "run.steps",
    "trainer.total_epochs": "run.epochs",
    "trainer.test_freq": "run.eval_every",
    "trainer.save_freq": "run.checkpoint_every",
    "trainer.logger": "tracking.trackers",
    "trainer.project_name": "tracking.wandb_project",
    "trainer.experiment_name": "run.name",
    # TRL (GRPOConfig)
    "num_generations": "rollout.group_size",
    "learning_rate": "trainer.lr",
    "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_length",
    "num_iterations": "trainer.ppo_epochs",
    "steps_per_generation": "trainer.ppo_mini_batches",
    "epsilon": "trainer.clip_low",
    "epsilon_high": "trainer.clip_high",
    "loss_type": "trainer.loss_agg_mode",
    "beta": "trainer.kl_coef",
    "max_steps": "run.steps",
    "num_train_epochs": "run.epochs",
    "eval_steps": "run.eval_every",
    "save_steps": "run.checkpoint_every",
    "report_to": "tracking.trackers",
    "run_name": "run.name",
    "use_vllm": "rollout.engine: vllm",
    # OpenRLHF
    "n_samples_per_prompt": "rollout.group_size",
    "rollout_batch_size": "rollout.prompts_per_step",
    "actor_learning_rate": "trainer.lr",
    "generate_max_len": "rollout.max_new_tokens",
    "prompt_max_len": "data.max_prompt_length",
    "init_kl_coef": "trainer.kl_coef",
    "max_epochs": "trainer.ppo_epochs",
    "num_episodes": "run.steps",
    # sluice-shaped guesses
    "rollout.n": "rollout.group_size",
    "rollout.batch_size": "rollout.prompts_per_step",
    "trainer.epochs": "trainer.ppo_epochs (per step) or run.epochs (passes over the prompts)",
    "trainer.learning_rate": "trainer.lr",
    "model.name": "model.path (a local folder)",
}
"""Dotted key a peer framework uses → the sluice key (and how to convert, where it is not a rename)."""


REMOVED_KEYS: dict[str, str] = {
    "fleet.rebalance_margin": (
        "removed: the rebalancing thresholds come from sluice plan's step model (docs/planner.md, "
        "'Dynamic rebalancing'); delete the key"
    ),
}
"""sluice keys that no longer exist → why, and what to do instead."""


def flat_keys(prefix: str, value: object) -> list[str]:
    """The dotted keys under ``prefix`` of a nested mapping (``prefix`` itself for a leaf)."""
    if not isinstance(value, dict) or not value:
        return [prefix]
    return [k for name, child in value.items() for k in flat_keys(f"{prefix}.{name}", child)]


def suggest(key: str, value: object, allowed: Iterable[str]) -> str:
    """What to write instead of the unknown ``key`` (holding ``value``): why a removed key went,
    else the sluice key a peer's name maps to, else the closest of ``allowed`` (the names of its
    section), else nothing."""
    for full in flat_keys(key, value):
        if full in REMOVED_KEYS:
            return f" ({full} was {REMOVED_KEYS[full]})"
        for peer in (full, *(full.rsplit(".", n)[0] for n in range(1, full.count(".") + 1))):
            if peer in PEER_NAMES:
                return f" ({peer} is sluice's {PEER_NAMES[peer]})"
    name = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, list(allowed), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""
