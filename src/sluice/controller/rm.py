"""``sluice rm``: trains a scalar Bradley–Terry reward model on the user's preference pairs.

The run reads ``data.train_files`` / ``val_files`` (``data/readers.py``) as TRL's preference rows
(``rm.chosen_key`` / ``rm.rejected_key``, conversational or plain text, an optional prompt at
``data.prompt_key``: ``data/preferences.py``), tokenises each side as a reward model reads a run's
responses (``rewards/reward_model.py``'s ``rm_input_ids``), loads ``model.path`` as a
sequence-classification model with one label (a causal LM folder gets a fresh score head) and
steps it with the pairwise loss (``trainer/rm.py``) on the RL trainer's engine: its strategies
(``single``, ``ddp``), dtype, LR schedules. Everything around the steps is ``sluice sft``'s
(``controller/supervised.py``): seeded epochs (``trainer/sft.py``'s ``batch_rows``), ranks,
``metrics.jsonl`` and trackers, ``plot.png``, checkpoints and ``resume=auto``, and ``final_model/``,
the HF folder ``reward.model`` takes. Every ``run.eval_every`` steps (and before the first and
after the last) it logs the pairwise accuracy, loss and margin of the validation pairs.
Deliberately not here: the loss and the forwards (``trainer/rm.py``, ``engines/scalar_model.py``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.config import SluiceConfig
from sluice.controller.supervised import RunLog, context_length, leave_if_spawned, resume_step, run_ranks, run_steps
from sluice.data import DatasetError, read_rows
from sluice.data.preferences import PreferenceRenderer
from sluice.engines.hf_model import load_scalar_model, load_tokenizer, on_device, slow_bf16_reason
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.scalar_model import pad_id_of
from sluice.preflight import check_rm
from sluice.rewards.reward_model import rm_input_ids
from sluice.telemetry import TrainProgress
from sluice.trainer.data_parallel import DataParallelGroup
from sluice.trainer.rm import Pair, pair_metrics, pair_sums, pairwise_step
from sluice.trainer.sections import engine_options
from sluice.trainer.sft import batch_rows, total_steps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RmResult:
    steps: int
    minutes: float
    final_model_dir: Path
    val_accuracy: float | None
    """Pairwise accuracy on the validation pairs after the last step (``None``: no validation)."""
    filtered: int
    """Training and validation pairs over ``rm.max_length`` that were dropped."""
    resumed_from: int = 0


@dataclass
class RmData:
    train: list[Pair]
    val: list[Pair]
    filtered: int
    tokenizer: Any


def load_rm_data(cfg: SluiceConfig, model_dir: str | Path) -> RmData:
    """Every training and validation pair of ``cfg.data``, tokenised and length-checked."""
    tokenizer = load_tokenizer(model_dir)
    limit = cfg.rm.max_length or context_length(model_dir)
    renderer = PreferenceRenderer(tokenizer, cfg.data, cfg.rm)
    dropped: Counter[str] = Counter()
    splits: list[list[Pair]] = []
    for files in (cfg.data.train_files, cfg.data.val_files):
        pairs: list[Pair] = []
        for path in files:
            rows = renderer.build(read_rows(path))
            for texts in rows.pairs:
                pair = (
                    rm_input_ids(tokenizer, *texts.chosen, rows.templated),
                    rm_input_ids(tokenizer, *texts.rejected, rows.templated),
                )
                longest = max(len(pair[0]), len(pair[1]))
                if longest <= limit:
                    pairs.append(pair)
                elif cfg.rm.long_rows == "error":
                    raise DatasetError(
                        f"{texts.where}: {longest} tokens, over rm.max_length ({limit}); shorten the pair, raise "
                        "rm.max_length, or set rm.long_rows=filter"
                    )
                else:
                    dropped[path] += 1
        splits.append(pairs)
    for path, count in dropped.items():
        log.warning("%s: %d pairs over rm.max_length (%d) dropped", path, count, limit)
    if not splits[0]:
        why = f"all {sum(dropped.values())} are over rm.max_length ({limit})" if dropped else "the files hold none"
        raise DatasetError(f"data.train_files: no training pairs: {why}")
    return RmData(splits[0], splits[1], sum(dropped.values()), tokenizer)


def reward_model_engine(model_dir: str | Path, cfg: SluiceConfig, steps: int) -> HFTrainEngine:
    """``model.path`` as a scalar model (a causal LM's trunk gets a new score head, a reward model
    keeps its own) on the trainer's engine, its LR schedule over ``steps`` steps."""
    model = on_device(load_scalar_model(model_dir, field="model.path", new_head=True))
    slow = slow_bf16_reason(model.device) if cfg.trainer.dtype == "bfloat16" else None
    if slow:
        log.warning("trainer.dtype=bfloat16 will be much slower than float32 here: %s", slow)
    return HFTrainEngine(model, **engine_options(cfg.trainer, 1.0, steps))


def run_rm(cfg: SluiceConfig, progress: TrainProgress | None = None) -> RmResult:
    """The whole ``sluice rm`` run (see the module docstring)."""
    check_rm(cfg)
    return run_ranks(cfg, _run_rank, progress, "rm")


def _run_rank(
    cfg: SluiceConfig, group_at: tuple[str, int] | None, progress: TrainProgress | None, rank: int
) -> RmResult:
    started = time.monotonic()
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    torch.manual_seed(cfg.run.seed)
    run_dir, model_dir = Path(cfg.run.output_dir) / cfg.run.name, cfg.model.path or ""
    data = load_rm_data(cfg, model_dir)
    n, batch = len(data.train), cfg.rm.batch_size
    steps = total_steps(n, batch, cfg.rm.epochs, cfg.rm.steps)
    limit = None if cfg.rm.steps is not None else round(cfg.rm.epochs * n)
    engine = reward_model_engine(model_dir, cfg, steps)
    pad_id = pad_id_of(engine.model)

    budget = cfg.trainer.micro_batch_tokens
    group = None if group_at is None else DataParallelGroup(group_at[0], rank, group_at[1], engine.device)
    if group is not None:
        engine.distribute(cfg.trainer.strategy, cpu_offload=cfg.trainer.cpu_offload)
    world, me = (group.world_size, group.rank) if group is not None else (1, 0)
    resumed = resume_step(cfg, run_dir, engine, "rm")
    log_to = RunLog(cfg, run_dir, resumed, progress, steps, "rm_loss") if rank == 0 else None
    log.info("rm: %d pairs (%d dropped), %d steps of %d pairs, from step %d", n, data.filtered, steps, batch, resumed)

    def train_step(step: int) -> dict[str, float]:
        began = time.perf_counter()
        pairs = [data.train[i] for i in batch_rows(n, batch, step, cfg.run.seed, limit)]
        out = pairwise_step(engine, pairs[me::world], budget, pad_id, float(len(pairs)))
        if group is not None:
            out = group.sum_metrics(out)
        tokens = sum(len(c) + len(r) for c, r in pairs)
        return {
            "rm_loss": out["loss"],
            "rm_accuracy": out["correct"] / len(pairs),
            "rm_margin": out["margin"] / len(pairs),
            "lr": out["lr"],
            "grad_norm": out["grad_norm"],
            "pairs": float(len(pairs)),
            "tokens": float(tokens),
            "tokens_per_s": tokens / max(time.perf_counter() - began, 1e-9),
            "epoch": (step + 1) * batch / n,
        }

    def evaluate(step: int) -> dict[str, float]:
        sums = pair_sums(engine, data.val[me::world], budget, pad_id)
        if group is not None:
            every = group.all_gather(sums)
            sums = {k: sum(s[k] for s in every) for k in sums}
        return pair_metrics(sums)

    due = data.val and cfg.run.eval_every > 0
    final, scores = run_steps(
        cfg, engine, data.tokenizer, (resumed, steps), train_step, evaluate if due else None, log_to, group
    )
    minutes = (time.monotonic() - started) / 60
    leave_if_spawned(rank)  # a spawned rank ends here, its process group still alive
    return RmResult(steps, minutes, final, scores.get("val_accuracy"), data.filtered, resumed)
