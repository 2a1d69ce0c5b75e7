"""``sluice.RLTrainer``: the user-level API (AsyncFlow §5.1) and the composition root of a run.

It wires config → task → engines → workflow → trainer and exposes AsyncFlow's verbs
(``init_engines``, ``load_prompt_data``, ``send_experience_data``, ``recv_experience_data``,
``sync_actor_model``, ``fit``) over one set of workers in every mode. The loop itself lives in
``controller/``; the numerics live in ``engines/`` and ``trainer/``. The CLI is a thin shell
over this class.

    from sluice import RLTrainer
    from sluice.config import load_config

    trainer = RLTrainer(load_config(None, ["run.steps=50"]))
    result = trainer.fit()
    print(result.base_accuracy, "->", result.final_accuracy)  # None with run.eval_every=0
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.api import PromptItem, RewardFn, SamplingParams
from sluice.config import ConfigError, SluiceConfig, dump_config, steps_of_epochs
from sluice.controller.recovery import Recovery
from sluice.controller.resume import DriverState, open_checkpoints
from sluice.controller.run_state import TrainingRun
from sluice.controller.step_by_step import StepByStep
from sluice.controller.training import run_training
from sluice.dag.run_dag import place_dag, plan_for_run
from sluice.data import DatasetError, PromptBuilder, PromptSet, PromptStream, in_memory, prompt_limit
from sluice.engines import build_inference_engine
from sluice.engines.hf_model import load_tokenizer
from sluice.preflight import preflight
from sluice.rewards import build_reward_service, check_reward
from sluice.rollout.agentic import env_rollout_spec
from sluice.rollout.evaluate import EvalResult, evaluate
from sluice.runtime.pipelines import PipelineSpec
from sluice.runtime.preemption import Preemption, RunPreempted, preemptible
from sluice.runtime.processes import run_tag, tagged_run
from sluice.runtime.run_lock import run_dir_lock
from sluice.tasks.base_model import ensure_base_model
from sluice.tasks.spec import TaskSpec, eval_rows, generate_rows
from sluice.telemetry import TrainProgress
from sluice.telemetry.disk_faults import disk_faults
from sluice.telemetry.plot import plot_run
from sluice.trainer.worker import TRAIN_TASK

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitResult:
    base_accuracy: float | None
    """Greedy accuracy before training (``None``: the run does not evaluate, ``run.eval_every: 0``
    or no evaluation set)."""
    final_accuracy: float | None
    """Greedy accuracy of the final model (``None`` likewise)."""
    steps: int
    minutes: float
    """The whole ``fit``, evaluations included."""
    loop_seconds: float
    """The training loop alone (what throughput is measured over)."""
    run_dir: Path
    final_model_dir: Path


class RLTrainer:
    """One RL run: ``RLTrainer(config).fit()``; or call the verbs one by one."""

    def __init__(self, config: SluiceConfig, *, reward: RewardFn | None = None) -> None:
        self.config = config
        self.task: TaskSpec = preflight(config, reward_given=reward is not None)
        check_reward(config.reward, reward, self.max_new_tokens)  # reward.fn / by_source imported: errors here
        self.reward: RewardFn = reward or self.task.reward
        self.run_dir = (Path(config.run.output_dir) / config.run.name).absolute()
        """Absolute, like ``model_dir``: worker processes (Ray actors) may run in another directory."""
        self.model_dir: Path | None = None
        self._engines_ready = False
        self._data_ready = False
        self.eval_items: list[PromptItem] | None = None
        """What evaluations run on (``load_prompt_data`` / ``load_eval_data``)."""
        self._step_by_step: StepByStep | None = None
        self._next_group = 0
        self.discarded: Counter[str] = Counter()
        """Samples of groups the verbs' waves discarded, per reason (``fit`` logs its own fates)."""
        self.filtered: dict[str, Counter[str]] = {}
        """Rows ``load_prompt_data`` left out, per split (``train``, ``val``) and reason."""
        torch.set_num_threads(config.run.threads or os.cpu_count() or 1)
        torch.manual_seed(config.run.seed)

    # -- AsyncFlow user-level API -------------------------------------------------------------

    def init_engines(self, on_sft_step: Callable[[int, float], None] | None = None, *, train: bool = True) -> None:
        """Resolve the model (building the embedded default if ``model.path`` is null) and the
        run's algorithm, sampling and DAG; the workers that hold the engines start with ``fit``.
        ``train=False`` loads one inference engine in this process instead (``evaluate``)."""
        cfg = self.config
        if cfg.model.path is None:
            model_dir = ensure_base_model(
                self.task, cfg.model.cache_dir, cfg.run.seed, cfg.task.eval_prompts, on_step=on_sft_step
            )
        else:
            model_dir = Path(cfg.model.path)
        self.model_dir = Path(model_dir).absolute()  # worker processes may run in another directory
        self.tokenizer = load_tokenizer(self.model_dir)
        if not train:
            self.engine = build_inference_engine(
                "hf", self.model_dir, max_batch=cfg.rollout.max_batch, options={"dtype": cfg.rollout.dtype}
            )
            self.reward_service = build_reward_service(cfg.reward, self.reward)
        self.params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        self.dag_plan = plan_for_run(cfg)
        self._engines_ready = True

    def load_prompt_data(self, rows: Iterable[dict[str, Any]] | None = None) -> None:
        """Validate the training prompts (``rows``, ``data.train_files``, or the task's generator)
        and the evaluation set (``data.val_files``, else the task's held-out set, or none when the
        training rows are the user's files), by the ``data`` section's mapping, chat and length
        rules. Training prompts that appear in the built-in held-out set are an error."""
        self._require_engines()
        assert self.model_dir is not None
        data, task = self.config.data, self.config.task
        builder = PromptBuilder(data, self.tokenizer, prompt_limit(data, self.model_dir, self.max_new_tokens))
        held_out: set[str] = set()
        if data.val_files:
            val = builder.read(data.val_files)
        elif data.train_files and rows is None:
            val = PromptSet()  # the user's data without a validation set: no evaluation
        else:
            held_out_rows = eval_rows(self.task, task.eval_prompts)
            val = builder.build(in_memory(held_out_rows, "held-out row"), keep_columns=True)
            held_out = {item.prompt for item in val.items}
        if rows is not None:
            train = builder.build(in_memory(list(rows)), keep_columns=True)
        elif data.train_files:
            train = builder.read(data.train_files)
        else:
            generated = generate_rows(self.task, task.train_prompts, self.config.run.seed + 1, exclude=held_out)
            train = builder.build(in_memory(generated), keep_columns=True)
        leaked = [it.index for it in train.items if it.prompt in held_out]
        if leaked:
            raise DatasetError(f"row {leaked[0] + 1}: prompt is in the held-out set ({len(leaked)} such rows)")
        epochs = self.config.run.epochs
        if epochs is not None:  # run.steps from the prompts read
            self.config = steps_of_epochs(self.config, len(train.items))
            log.info("run.epochs %g over %d prompts: run.steps %d", epochs, len(train.items), self.config.run.steps)
        self.eval_items = val.items
        self.filtered = {"train": train.filtered, "val": val.filtered}
        self.prompts = PromptStream(train.items, self.config.run.seed)
        self._data_ready = True

    def load_eval_data(self, path: str | Path) -> None:
        """A user's validation rows (any format ``data.train_files`` takes) as the evaluation set,
        in place of the task's held-out set (``sluice eval --data``), by the ``data`` section's rules."""
        self._require_engines()
        assert self.model_dir is not None
        data = self.config.data
        builder = PromptBuilder(data, self.tokenizer, prompt_limit(data, self.model_dir, self.max_new_tokens))
        self.eval_items = builder.read((str(path),)).items

    def evaluate(self) -> EvalResult:
        """The model's scores on the evaluation set (``init_engines(train=False)``, then
        ``load_prompt_data`` or ``load_eval_data``): greedy accuracy and, with ``eval.samples``,
        mean@k / pass@k; overall and per ``data_source``."""
        if self.eval_items is None:
            raise RuntimeError("call load_prompt_data() or load_eval_data() first")
        if not self.eval_items:
            raise DatasetError("nothing to evaluate: the evaluation set is empty (data.val_files gives one)")
        cfg = self.config
        return evaluate(
            self.engine, self.eval_items, self.tokenizer, self.reward_service, self.max_new_tokens, cfg.eval,
            seed=cfg.run.seed,
        )  # fmt: skip

    # -- the loop by hand: the same workers as fit, one verb at a time -------------------------

    def send_experience_data(self, num_groups: int | None = None) -> list[int]:
        """Generate and score the next ``num_groups`` prompt groups (default
        ``rollout.prompts_per_step``) with the engines' current weights, as one wave, and write
        them to the TransferQueue. Returns the ids of the groups stored; a group a filter or a
        failed reward discarded is counted in ``discarded`` instead."""
        session = self._session()
        count = num_groups or self.config.rollout.prompts_per_step
        groups = [(item, self._next_group + k) for k, item in enumerate(self.prompts.take(count))]
        self._next_group += count
        stored = []
        for report in session.generate(groups):
            if report.discard_reason is None:
                stored.append(report.group_id)
            else:
                self.discarded[report.discard_reason] += report.num_samples
        return sorted(stored)

    def recv_experience_data(self, group_ids: Sequence[int]) -> dict[str, float]:
        """The trainer receives these stored groups from the TransferQueue (it reads them itself)
        and takes one optimizer step over them, in this order: version v → v + 1. Its metrics."""
        return self._session().train(group_ids)

    def sync_actor_model(self) -> dict[str, float]:
        """The inference engines load the trainer's newest version; the sync's timings."""
        return self._session().sync_weights()

    def save_model(self, path: str | Path) -> None:
        """The trained policy and the tokenizer as an HF folder."""
        self._session().save(str(path))
        self.tokenizer.save_pretrained(path)

    def close(self) -> None:
        """Stop the workers the verbs started (``fit`` manages its own)."""
        if self._step_by_step is not None:
            self._step_by_step.close()
            self._step_by_step = None

    def _session(self) -> StepByStep:
        if not self._data_ready:
            raise RuntimeError("call load_prompt_data() first")
        if self._step_by_step is None:
            self._step_by_step = StepByStep(self.config, self.pipeline_spec(), self.prompts)
        return self._step_by_step

    def fit(self, progress: TrainProgress | None = None) -> FitResult:
        """Run the whole training (``run.mode``: the sync or the async schedule of the same
        workers): base eval, the loop (an eval every ``run.eval_every`` steps), final eval (none
        with ``run.eval_every: 0`` or an empty evaluation set), the final model saved as an HF
        folder, metrics, samples and the timeline trace; the trackers closed, ``plot.png`` drawn."""
        cfg = self.config
        if cfg.tracking.plot and importlib.util.find_spec("matplotlib") is None:  # say so before training
            raise ConfigError(
                "tracking.plot: matplotlib is not installed (pip install matplotlib, or tracking.plot=false)"
            )
        if not self._engines_ready:
            self.init_engines()
        if not self._data_ready:
            self.load_prompt_data()
        # one driver per run dir (runtime/run_lock.py), taken before anything in it is read or written;
        # a write the disk refuses (full, read-only) stops the run with one line naming the file
        with disk_faults(self.run_dir), run_dir_lock(self.run_dir):
            # SIGTERM / SIGINT stop the run at the next step boundary with a checkpoint (RunPreempted);
            # its processes carry its tag (a crashed predecessor's swept first, none outlives it)
            with preemptible(run_tag(self.run_dir)) as preemption, tagged_run(self.run_dir):
                run, base, final = self._run_training(progress, preemption)
            self.tokenizer.save_pretrained(run.final_model_dir)
            if cfg.tracking.plot:
                plot_run(self.run_dir)
        minutes = (time.monotonic() - run.started) / 60
        return FitResult(
            None if base is None else base.accuracy,
            None if final is None else final.accuracy,
            run.version,
            minutes,
            run.loop_seconds,
            run.run_dir,
            run.final_model_dir,
        )

    def _run_training(
        self, progress: TrainProgress | None, preemption: Preemption
    ) -> tuple[TrainingRun, EvalResult | None, EvalResult | None]:
        """Open the run (checkpoints, logs) and run the loop: the run as it ended, its base and
        final evaluations. A worker that dies or stalls is recovered from inside this call, up to
        ``run.max_restarts`` times (``controller/recovery.py``): the loop runs again from the last
        complete checkpoint, as ``resume=auto`` would."""
        recovery, started = Recovery(self.config.run.max_restarts), time.monotonic()
        while True:
            run, resumed = self._open_run(progress, recovery)
            run.started = started
            try:
                base, final = asyncio.run(run_training(run, self.pipeline_spec(), resumed, preemption))
            except RunPreempted:
                run.close_logs()  # stopped at a checkpoint: the trackers' runs end as they would
                raise
            except BaseException as err:
                run.close_logs(failed=True)  # the trackers' runs end (wandb's marked failed)
                if recovery.restarts(err, preemption.requested):
                    continue  # the workers are gone (run_training's finally): place them again
                raise
            run.close_logs()
            return run, base, final

    def _open_run(self, progress: TrainProgress | None, recovery: Recovery) -> tuple[TrainingRun, DriverState | None]:
        """One attempt's run: its checkpoints (after a restart, ``resume=auto``'s), logs, trackers."""
        cfg = self.config
        checkpoints, resumed_from, resumed = open_checkpoints(recovery.config(cfg), self.run_dir)
        self.prompts.position = 0  # a fresh start's; a resume's comes from its checkpoint
        run = TrainingRun(
            cfg, self.run_dir, self.prompts, self.eval_items or [], self.max_new_tokens, checkpoints, resumed_from,
            tokenizer=self.tokenizer,
        )  # fmt: skip
        run.open_logs(append=resumed is not None)
        if resumed is None:
            filtered = {f"{split}_filtered_{why}": n for split, c in self.filtered.items() for why, n in c.items()}
            run.metrics.log("data", train_prompts=len(self.prompts.items), val_prompts=len(self.eval_items), **filtered)
        recovery.record(run, resumed_from, 0 if resumed is None else resumed.version)
        if progress is not None:
            run.progress = progress
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        return run, resumed

    def pipeline_spec(self) -> PipelineSpec:
        """What the workers are built from: the config's sections and the run's resolved pieces."""
        self._require_engines()
        assert self.model_dir is not None
        agentic = env_rollout_spec(self.config.agentic, self.task.env, self.max_new_tokens)
        return PipelineSpec(
            self.config, self.model_dir, self.reward, self.params,
            dag=place_dag(self.dag_plan, TRAIN_TASK), agentic=agentic,
        )  # fmt: skip

    @property
    def max_new_tokens(self) -> int:
        return self.config.rollout.max_new_tokens or self.task.max_new_tokens

    def _require_engines(self) -> None:
        if not self._engines_ready:
            raise RuntimeError("call init_engines() first")
