"""The ``sluice`` command line: ``train``, ``sft``, ``eval``, ``bench``, ``trace``, ``plot``, ``plan``,
``simulate``, ``plan-dag``, ``config-docs``.

It parses arguments, renders progress and results, and turns the known user errors (config,
dataset, model path) into one line on stderr with exit code 2, and a run that stopped itself
(``RunStopped``: a reward or environment over its failure budget, a worker lost or silent) into
its one line with exit code 1. A training run stopped by SIGTERM (SIGINT) at a checkpoint says
so in one line and exits with 143 (130). All work is delegated to
``sluice.RLTrainer`` and the evaluator.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from sluice.config import ConfigError, SluiceConfig, dump_config, load_config

if TYPE_CHECKING:
    from sluice.rollout.evaluate import EvalScores


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, stray = parser.parse_known_args(argv)
    takes = next((name for name in ("overrides", "args") if hasattr(args, name)), None)
    if stray and takes and all("=" in a and not a.startswith("-") for a in stray):
        setattr(args, takes, [*getattr(args, takes), *stray])  # key=value after an option: `train C --dry-run k=v`
    elif stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except _run_stops() as err:  # the run stopped itself (e.g. a failure budget): its one line
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Asynchronous streaming RL post-training.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train", help="run training", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  sluice train my_run.yaml run.steps=100 rollout.group_size=8 --dry-run\n\n"
        "every key: sluice config-docs (docs/config.md); resume=auto continues the run's last checkpoint",
    )  # fmt: skip
    train.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...] [resume=auto|PATH]")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    train.set_defaults(func=_train)
    sft = sub.add_parser(
        "sft", help="supervised fine-tuning (the warm start before train)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  sluice sft my_sft.yaml data.train_files=chats.jsonl sft.epochs=2\n\n"
        "then: sluice train my_run.yaml model.path=runs/<run.name>/final_model\n"
        "every key: sluice config-docs (docs/config.md, docs/sft.md); resume=auto continues the last checkpoint",
    )  # fmt: skip
    sft.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...] [resume=auto|PATH]")
    sft.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    sft.set_defaults(func=_sft)
    ev = sub.add_parser(
        "eval", help="evaluate a model folder: greedy accuracy, mean@k / pass@k, per source",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  sluice eval runs/my_run/final_model --data val.parquet eval.samples=4 "
        "reward.fn=my_rewards.py:fn\n\nevery key: sluice config-docs (docs/config.md)",
    )  # fmt: skip
    ev.add_argument("model_dir")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. eval.samples=4 reward.name=...")
    ev.add_argument(
        "--data", metavar="FILE",
        help="validation rows (JSONL, JSON, parquet or a datasets folder; default: the task's held-out set)",
    )  # fmt: skip
    ev.set_defaults(func=_eval)
    bench = sub.add_parser("bench", help="end-to-end benchmarks (bench e2e: sync vs streaming vs async)")
    bench.add_argument("kind", choices=["e2e"])
    bench.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every variant")
    bench.add_argument("--variants", help="comma-separated subset, e.g. 'sync,async η=1'")
    bench.add_argument(
        "--workload", default="default", choices=["default", "agentic-wait", "reward-wait"],
        help="what is trained: the config as given, or a waiting-bound workload (env or reward calls wait μ ± μ s)",
    )  # fmt: skip
    bench.add_argument("--out", default="benchmarks/results/e2e.json", help="JSON output path")
    bench.set_defaults(func=_bench)
    trace = sub.add_parser("trace", help="render a run's timeline (trace.json) to a PNG Gantt chart")
    trace.add_argument("path", help="run directory or trace JSON file")
    trace.add_argument("-o", "--output", help="PNG path (default: next to the trace, trace.png)")
    trace.set_defaults(func=_trace)
    plot = sub.add_parser("plot", help="draw a run's curves (metrics.jsonl) to a PNG: reward, accuracy, length, ...")
    plot.add_argument("run_dir", help="run directory (holds metrics.jsonl)")
    plot.add_argument("-o", "--output", help="PNG path (default: RUN_DIR/plot.png)")
    plot.set_defaults(func=_plot)
    from sluice.sim.commands import add_commands

    add_commands(sub)  # plan, simulate
    dag_plan = sub.add_parser("plan-dag", help="compile a DAG file and print its stages and placement")
    dag_plan.add_argument("file", help="DAG YAML file, or a built-in name (grpo, grpo_kl, ppo, ppo_kl)")
    dag_plan.add_argument("--placement", choices=["colocated", "disaggregated"], default="colocated")
    dag_plan.set_defaults(func=_plan_dag)
    docs = sub.add_parser("config-docs", help="print the configuration reference (Markdown)")
    docs.set_defaults(func=lambda _: print(_config_reference()) or 0)
    return parser


def _split_args(items: Sequence[str]) -> tuple[str | None, list[str]]:
    path = None
    overrides = []
    for item in items:
        if item.startswith("resume="):  # `sluice train CONFIG resume=auto`: short for run.resume
            overrides.append(f"run.{item}")
        elif "=" in item:
            overrides.append(item)
        elif path is None:
            path = item
        else:
            raise ConfigError(f"unexpected argument {item!r}: give one config file and key=value overrides")
    return path, overrides


def _run_config(args: argparse.Namespace, console: Console) -> SluiceConfig | None:
    """``train`` / ``sft``'s config from ``CONFIG [key=value ...]``; ``None`` after ``--dry-run``
    printed it."""
    path, overrides = _split_args(args.args)
    cfg = load_config(path, overrides)
    if args.dry_run:
        console.print(dump_config(cfg), end="", markup=False, highlight=False)
        return None
    return cfg


def _train(args: argparse.Namespace) -> int:
    console = Console()
    cfg = _run_config(args, console)
    if cfg is None:
        return 0
    _check_before_torch(cfg)
    from sluice.rl_trainer import RLTrainer
    from sluice.runtime.preemption import RunPreempted
    from sluice.telemetry import TrainProgress

    trainer = RLTrainer(cfg)
    with TrainProgress(trainer.task.sft.steps, "SFT warm start", cfg.run.progress, console) as sft_bar:
        trainer.init_engines(on_sft_step=lambda step, loss: sft_bar.update(step, loss=loss))
    trainer.load_prompt_data()
    console.print(f"model {trainer.model_dir}  run dir {trainer.run_dir}")
    try:
        with TrainProgress(trainer.config.run.steps, "train", cfg.run.progress, console) as bar:  # epochs: derived
            result = trainer.fit(progress=bar)
    except RunPreempted as stopped:  # SIGTERM / SIGINT: stopped at a checkpoint, every process gone
        print(stopped, file=sys.stderr, flush=True)
        return stopped.exit_code
    console.print(f"steps {result.steps} in {result.minutes:.1f} min; final model {result.final_model_dir}")
    if result.base_accuracy is None or result.final_accuracy is None:
        print("no evaluation (run.eval_every=0, or data.train_files without data.val_files)", flush=True)
    else:
        print(f"accuracy {100 * result.base_accuracy:.1f} -> {100 * result.final_accuracy:.1f}", flush=True)
    return 0


def _sft(args: argparse.Namespace) -> int:
    console = Console()
    cfg = _run_config(args, console)
    if cfg is None:
        return 0
    from sluice.preflight import check_sft

    check_sft(cfg)  # before torch: a wrong key or model path costs a blink
    from sluice.engines.model_folder import check_model_dir

    check_model_dir(cfg.model.path or "")
    from sluice.controller.sft import run_sft
    from sluice.telemetry import TrainProgress

    with TrainProgress(0, "sft", cfg.run.progress, console) as bar:  # its total: once the rows are read
        result = run_sft(cfg, progress=bar)
    dropped = f"; {result.filtered} rows over sft.max_length dropped" if result.filtered else ""
    console.print(f"steps {result.steps} in {result.minutes:.1f} min; final model {result.final_model_dir}{dropped}")
    scores = [
        f"{k} {v:.4f}" for k, v in (("val_loss", result.val_loss), ("accuracy", result.accuracy)) if v is not None
    ]
    print("  ".join(scores) if scores else "no evaluation (run.eval_every=0, or no data.val_files)", flush=True)
    return 0


def _eval(args: argparse.Namespace) -> int:
    cfg = load_config(None, [*args.overrides, f"model.path={args.model_dir}"])
    _check_before_torch(cfg)
    if args.data:
        from sluice.data import check_user_data

        check_user_data(cfg, reward_given=False, files="--data")
    from sluice.rl_trainer import RLTrainer

    trainer = RLTrainer(cfg)
    trainer.init_engines(train=False)
    if args.data:
        trainer.load_eval_data(args.data)
    else:
        trainer.load_prompt_data()
    result = trainer.evaluate()
    what = args.data or "held-out"
    sampled = f", {result.samples} samples at T={cfg.eval.temperature}" if result.samples else ""
    print(f"{_scores(result, result.samples)}  ({result.count} {what} prompts, greedy{sampled})")
    if len(result.by_source) > 1 or args.data:
        for source, scores in result.by_source.items():
            print(f"  {source}: {_scores(scores, result.samples)}  ({scores.count} prompts)")
    buckets = "  ".join(f"{k} {100 * v.accuracy:.1f}" for k, v in result.by_bucket.items())
    if buckets:
        print(f"  by bucket: {buckets}")
    return 0


def _check_before_torch(cfg: SluiceConfig) -> None:
    """A wrong ``model.path``, task name, agentic section or data setting is said before torch and
    transformers are imported (seconds)."""
    from sluice.preflight import preflight

    if cfg.model.path:
        from sluice.engines.model_folder import check_model_dir

        check_model_dir(cfg.model.path)
    preflight(cfg, reward_given=False)


def _scores(scores: EvalScores, k: int) -> str:
    text = f"accuracy {100 * scores.accuracy:.1f}"
    if scores.mean_at_k is not None and scores.pass_at_k is not None:
        text += f"  mean@{k} {100 * scores.mean_at_k:.1f}  pass@{k} {100 * scores.pass_at_k:.1f}"
    return text


def _bench(args: argparse.Namespace) -> int:
    from sluice.bench.e2e import (
        DEFAULT_VARIANTS,
        VARIANTS,
        WAIT_VARIANTS,
        format_table,
        run_e2e,
        workload_overrides,
        write_json,
    )

    default = DEFAULT_VARIANTS if args.workload == "default" else WAIT_VARIANTS
    variants = [v.strip() for v in args.variants.split(",")] if args.variants else default
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"bench e2e --variants: unknown {unknown} (choose from {list(VARIANTS)})")
    load_config(None, args.overrides)  # fail fast on a bad override
    overrides, mu = workload_overrides(args.workload, args.overrides, "runs/bench_e2e")
    if mu is not None:
        print(f"workload {args.workload}: μ = σ = {mu:.4f} s (median wall time of one generation turn, measured)")
    rows = run_e2e(overrides, variants=variants)
    print(format_table(rows))
    print(f"wrote {write_json(rows, args.out, overrides, args.workload, mu)}")
    return 0


def _trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sluice.telemetry.gantt import render_gantt
    from sluice.telemetry.trace import read_chrome_trace, trace_summary

    path = Path(args.path)
    trace_path = path / "trace.json" if path.is_dir() else path
    if not trace_path.is_file():
        raise ConfigError(f"trace: {trace_path} not found (run with run.trace=true, or pass a trace JSON)")
    events = read_chrome_trace(trace_path)
    png = render_gantt(events, args.output or trace_path.with_suffix(".png"), title=str(trace_path.parent.name))
    summary = trace_summary(events)
    idle = summary.get("trainer_idle_fraction")
    idle_text = "n/a" if idle is None else f"{100 * idle:.0f}%"
    print(f"wrote {png}  (wall {summary['wall_s']:.1f}s, trainer idle {idle_text})")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from sluice.telemetry.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.output)}")
    return 0


def _plan_dag(args: argparse.Namespace) -> int:
    from sluice.dag import compile_dag, load_dag

    print(compile_dag(load_dag(args.file), args.placement).render())
    return 0


def _config_reference() -> str:
    from sluice.config.reference import config_reference

    return config_reference()


_USER_ERRORS = {
    "sluice.dag.spec": "DagError",
    "sluice.data.readers": "DatasetError",
    "sluice.engines.model_folder": "ModelPathError",
    "sluice.telemetry.plot": "MetricsFileError",
}
"""The errors that are a user's input, by defining module. Only modules already imported are asked:
an error whose class was never imported cannot have been raised, and importing ``hf_model`` (torch
and transformers, seconds) to say that a config key is wrong would make every such error slow."""


def _user_errors() -> tuple[type[Exception], ...]:
    loaded = (getattr(sys.modules[module], name) for module, name in _USER_ERRORS.items() if module in sys.modules)
    return (ConfigError, *loaded)


def _run_stops() -> tuple[type[Exception], ...]:
    from sluice.schedule.failures import RunStopped

    return (RunStopped,)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
