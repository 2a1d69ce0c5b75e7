"""The embedded default's base model: build tokenizer + tiny Llama, SFT-warm-start, cache on disk.

``ensure_base_model`` returns a local Hugging Face folder; the run then loads it with
``from_pretrained`` like any user model. The folder name hashes everything that shapes the
weights, so a changed recipe rebuilds and an unchanged one is reused (idempotent). It does not
evaluate or train with RL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from transformers.utils import logging as hf_logging

from sluice.tasks.spec import TaskSpec, eval_rows
from sluice.tasks.tiny_model import build_char_tokenizer, build_tiny_llama
from sluice.tasks.warm_start import sft_warm_start

log = logging.getLogger(__name__)

_RECIPE_VERSION = 2
"""2: the warm start steps on `sluice sft`'s packed step (`trainer/sft.py`), not a padded loop of its own."""


def base_model_dir(task: TaskSpec, cache_dir: str | Path, seed: int, eval_count: int) -> Path:
    recipe = {
        "v": _RECIPE_VERSION,
        "task": task.name,
        "revision": task.revision,
        "alphabet": task.alphabet,
        "model": asdict(task.model),
        "sft": asdict(task.sft),
        "seed": seed,
        "eval_seed": task.eval_seed,
        "eval_count": eval_count,
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    return Path(cache_dir) / f"{task.name}-base-{digest}"


def ensure_base_model(
    task: TaskSpec,
    cache_dir: str | Path,
    seed: int,
    eval_count: int,
    on_step: Callable[[int, float], None] | None = None,
) -> Path:
    """Return the cached base model folder for ``task``, building it first if needed."""
    target = base_model_dir(task, cache_dir, seed, eval_count)
    if _complete(target):
        return target
    started = time.monotonic()
    tokenizer = build_char_tokenizer(task.alphabet)
    model = build_tiny_llama(task.model, tokenizer, seed)
    held_out = {row["prompt"] for row in eval_rows(task, eval_count)}

    def demonstration(rng: random.Random) -> tuple[str, str]:
        while True:
            row = task.make_row(rng)
            if row["prompt"] in held_out:
                continue
            if task.demonstrate_turn is not None:  # multi-turn: one turn of a demonstrated episode
                return task.demonstrate_turn(row, rng)
            return row["prompt"], task.demonstrate(row, rng)

    losses = sft_warm_start(
        model,
        tokenizer,
        demonstration,
        steps=task.sft.steps,
        batch_size=task.sft.batch_size,
        lr=task.sft.lr,
        warmup_steps=task.sft.warmup_steps,
        seed=seed + 7,
        on_step=on_step,
    )
    hf_logging.disable_progress_bar()
    # A folder of this process's own: two runs (or test workers) building the same recipe at once
    # each write their own copy, and the first rename wins.
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "sluice_base.json").write_text(
        json.dumps(
            {
                "task": task.name,
                "sft_final_loss": losses[-1] if losses else None,
                "sft_seconds": round(time.monotonic() - started, 1),
                "parameters": sum(p.numel() for p in model.parameters()),
            },
            indent=2,
        )
    )
    if _complete(target):
        shutil.rmtree(partial)  # another process finished the same recipe first: the same weights
        return target
    shutil.rmtree(target, ignore_errors=True)
    try:
        partial.rename(target)
    except OSError:  # another process renamed its copy in between (the target is then not empty)
        shutil.rmtree(partial)
    log.info("built base model %s in %.1fs", target, time.monotonic() - started)
    return target


def _complete(folder: Path) -> bool:
    """A finished base model folder (the last rename made it whole)."""
    return (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
