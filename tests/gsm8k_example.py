"""The ``examples/gsm8k_style`` scripts as modules, for tests that build its data and model."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).parents[1] / "examples" / "gsm8k_style"


def load(name: str) -> ModuleType:
    """``examples/gsm8k_style/<name>.py`` imported under a unique module name."""
    spec = importlib.util.spec_from_file_location(f"gsm8k_style_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def warm_start(data_dir: Path, root: Path, spec_overrides: dict, steps_epochs: float = 0.8) -> tuple[Path, dict, Path]:
    """The example's pipeline on small data: ``make_model.build`` (a tiny ``spec_overrides`` model)
    into ``root/init``, then ``sluice sft`` with ``sft.yaml`` for ``steps_epochs`` epochs of 8 rows
    a step; returns (final model folder, ``build``'s summary, the SFT run dir)."""
    from sluice.config import load_config
    from sluice.controller.sft import run_sft

    make_model = load("make_model")
    summary = make_model.build(data_dir, root / "init", vocab_size=400, spec=make_model.ModelSpec(**spec_overrides))
    overrides = [
        f"model.path={root / 'init'}", f"data.train_files={data_dir / 'sft.parquet'}",
        f"data.val_files={data_dir / 'test.parquet'}", f"sft.epochs={steps_epochs}", "sft.batch_size=8",
        "trainer.lr=3e-3", "trainer.lr_warmup_steps=2", "eval.max_prompts=4", "rollout.max_new_tokens=8",
        f"run.output_dir={root}", "run.eval_every=10", "run.progress=false", "tracking.plot=false",
    ]  # fmt: skip
    result = run_sft(load_config(EXAMPLE / "sft.yaml", overrides))
    return result.final_model_dir, summary, root / "sft"
