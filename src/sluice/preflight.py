"""The checks of a run's config that need neither torch nor the model: a built-in task's name,
the agentic section against the task, the user's data files against the response cap and
the reward, and what ``sluice sft`` and ``sluice rm`` need (``check_sft``, ``check_rm``).

``sluice train`` / ``sluice eval`` run them before importing torch and transformers (seconds), so
a wrong key costs a user a blink; ``RLTrainer`` runs them too, for runs started from Python. The
checks that need the tokenizer or the reward's module (rows, reward functions) stay with the run.
"""

from __future__ import annotations

from sluice.config import ConfigError, SluiceConfig
from sluice.data import check_user_data
from sluice.engines.model_folder import check_reward_model_dir
from sluice.tasks import TASKS
from sluice.tasks.spec import TaskSpec


def preflight(config: SluiceConfig, reward_given: bool) -> TaskSpec:
    """The run's built-in task, once its config passed the torch-free checks (``ConfigError``)."""
    task = TASKS.get(config.task.name)
    if task is None:
        raise ConfigError(f"task.name: unknown task {config.task.name!r} (built-in: {', '.join(TASKS)})")
    check_agentic(config, task.env)
    check_user_data(config, reward_given=reward_given)
    if config.reward.model is not None:
        check_reward_model_dir(config.reward.model)
    return task


def check_agentic(config: SluiceConfig, task_env: str | None) -> None:
    """A multi-turn run needs ``num_env_groups`` at least the step's groups and scores its episodes
    itself (no ``reward.model`` / ``judge``); an agent excludes an explicit ``env`` and the barrier
    mode. Raises ``ConfigError`` naming the field."""
    agentic = config.agentic
    multi_turn = agentic.agent is not None or (agentic.env or task_env) is not None
    if multi_turn and (config.reward.model is not None or config.reward.judge is not None):
        which = "reward.model" if config.reward.model is not None else "reward.judge"
        raise ConfigError(f"{which}: single-turn rollouts only (an environment or agent scores its episodes)")
    if agentic.agent is not None and agentic.env is not None:
        raise ConfigError(f"agentic.agent: {agentic.agent!r} and agentic.env: {agentic.env!r} exclude each other")
    if agentic.agent is not None and agentic.mode == "barrier":
        raise ConfigError("agentic.mode: 'barrier' moves Env episodes in lockstep; an agent's turns are its own")
    if agentic.num_env_groups is not None and agentic.num_env_groups < config.rollout.prompts_per_step:
        raise ConfigError(
            f"agentic.num_env_groups: {agentic.num_env_groups} is below rollout.prompts_per_step "
            f"({config.rollout.prompts_per_step})"
        )


def check_sft(cfg: SluiceConfig) -> None:
    """What ``sluice sft`` needs before torch is imported; ``ConfigError`` naming the field."""
    if not cfg.model.path:
        raise ConfigError("model.path: sluice sft trains a model folder; set model.path")
    if not cfg.data.train_files:
        raise ConfigError(
            "data.train_files: sluice sft needs training rows (JSONL, JSON, parquet or a datasets folder)"
        )
    if cfg.trainer.strategy != "single" and has_reward(cfg) and cfg.data.val_files:
        raise ConfigError(
            f"reward: the accuracy evaluation of sluice sft runs in one process (trainer.strategy: single, got "
            f"{cfg.trainer.strategy!r}); unset the reward and evaluate final_model with sluice eval"
        )
    if has_reward(cfg) and cfg.data.val_files and cfg.rollout.max_new_tokens is None:
        raise ConfigError("rollout.max_new_tokens: the accuracy evaluation of sluice sft needs a response limit")


def check_rm(cfg: SluiceConfig) -> None:
    """What ``sluice rm`` needs before torch is imported; ``ConfigError`` naming the field."""
    if not cfg.model.path:
        raise ConfigError("model.path: sluice rm trains a model folder (a causal LM or a reward model); set model.path")
    if not cfg.data.train_files:
        raise ConfigError(
            "data.train_files: sluice rm needs preference pairs (JSONL, JSON, parquet or a datasets folder)"
        )
    if cfg.trainer.strategy == "fsdp2":
        raise ConfigError("trainer.strategy: sluice rm runs single or ddp (fsdp2: not yet)")
    if cfg.trainer.lora_rank:
        raise ConfigError("trainer.lora_rank: sluice rm trains the whole model (its new score head must train)")


def has_reward(cfg: SluiceConfig) -> bool:
    return bool(cfg.reward.name or cfg.reward.fn or cfg.reward.by_source)
