"""The ``sluice`` command line: ``train``, ``sft``, ``rm``, ``eval``, ``init``, ``bench``, ``trace``, ``plot``,
``plan``, ``simulate``, ``plan-dag``, ``config-docs``.

It parses arguments, renders progress and results, and turns the known user errors (config,
dataset, model path) into one line on stderr with exit code 2, and a run that stopped itself
(``RunStopped``: a reward or environment over its failure budget, a worker lost or silent, a
write the disk refused) into its one line with exit code 1. A training run stopped by SIGTERM
(SIGINT) at a checkpoint says so in one line and exits with 143 (130). All work is delegated to
``sluice.RLTrainer`` and the evaluator.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rich.console import Console

from sluice.config import ConfigError, SluiceConfig, dump_config, load_config

if TYPE_CHECKING:
    from sluice.controller.rm import RmResult
    from sluice.controller.sft import SftResult
    from sluice.rollout.evaluate import EvalScores
    from sluice.tasks.spec import TaskSpec


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except _run_stops() as err:  # the run stopped itself (e.g. a failure budget, a full disk): its one line
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a write the disk refused outside a run (a model cache, a bench's JSON)
        from sluice.telemetry.disk_faults import diagnose

        fault = diagnose(err, Path.cwd())
        if fault is None:
            raise
        print(f"error: {fault}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


_OVERRIDE = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*=")
"""A ``section.key=value`` token (what ``--variants 'sync,async η=1'`` or a path never looks like)."""


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments, with every ``key=value`` after the command taken as an override wherever it
    stands (before, between or after positionals and options); a command without overrides
    refuses them in one line."""
    at = next((k for k, a in enumerate(argv) if not a.startswith("-")), len(argv))
    pulled = [a for a in argv[at + 1 :] if _OVERRIDE.match(a)]
    args = parser.parse_args([*argv[: at + 1], *(a for a in argv[at + 1 :] if not _OVERRIDE.match(a))])
    takes = next((name for name in ("overrides", "args") if hasattr(args, name)), None)
    if pulled and takes is None:
        parser.error(f"{argv[at]} takes no key=value overrides (got {' '.join(pulled)})")
    if takes is not None:
        setattr(args, takes, [*getattr(args, takes), *pulled])
    return args


EXAMPLES = {
    "train": ("sluice train my_run.yaml run.steps=100 rollout.group_size=8 --dry-run",
              "resume=auto continues the run's last checkpoint"),
    "sft": ("sluice sft my_sft.yaml data.train_files=chats.jsonl sft.epochs=2",
            "then: sluice train my_run.yaml model.path=runs/<run.name>/final_model; resume=auto continues the last "
            "checkpoint; docs/sft.md"),
    "rm": ("sluice rm my_rm.yaml data.train_files=pairs.jsonl rm.epochs=2",
           "then: sluice train my_run.yaml reward.model=runs/<run.name>/final_model; docs/rewards.md"),
    "eval": ("sluice eval runs/my_run/final_model --data val.parquet eval.samples=4 reward.fn=my_rewards.py:fn", ""),
    "init": ("sluice init --model my_model --data train.parquet --val val.parquet --reward my_rewards.py:score",
             "then: sluice train my_run.yaml run.steps=2"),
    "bench": ("sluice bench e2e run.steps=30 --variants 'sync,async η=1'", "the overrides apply to every variant"),
    "trace": ("sluice trace runs/default -o timeline.png", "a run writes trace.json with run.trace=true"),
    "plot": ("sluice plot runs/default -o curves.png", ""),
    "plan": ("sluice plan --model qwen2.5-7b --device H100 --devices 16 --batch 64", ""),
    "simulate": ("sluice simulate --model qwen2.5-7b --device H100 --rollout-devices 8 --train-devices 8", ""),
    "plan-dag": ("sluice plan-dag grpo --placement disaggregated", ""),
    "config-docs": ("sluice config-docs > config.md", ""),
}  # fmt: skip
"""Each command's ``--help`` example, and a note before the pointer to the reference."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Asynchronous streaming RL post-training.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for name, what, run in (
        ("train", "run training", _train),
        ("sft", "supervised fine-tuning (the warm start before train)", _supervised),
        ("rm", "train a scalar reward model on preference pairs (reward.model takes it)", _supervised),
    ):
        command = sub.add_parser(name, help=what)
        command.add_argument(
            "args", nargs="*", metavar="[CONFIG.yaml ...] [key=value ...] [resume=auto|PATH]",
            help="config files merged in order (a later file's keys win), then the overrides",
        )  # fmt: skip
        command.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        command.set_defaults(func=run, command=name)
    ev = sub.add_parser("eval", help="evaluate a model folder: greedy accuracy, mean@k / pass@k, per source")
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
    bench.add_argument(
        "--variants", help="comma-separated subset, e.g. 'sync,async η=1'; 'vllm': the vLLM rows (in .venv-vllm)"
    )
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
    init = sub.add_parser(
        "init", help="write a first run config from a model folder and a data file (guessed, checked)"
    )
    init.add_argument("--model", required=True, metavar="PATH", help="local Hugging Face model folder")
    init.add_argument(
        "--data", required=True, metavar="FILE", help="training rows: JSONL, JSON, parquet or a datasets folder"
    )
    init.add_argument("--val", metavar="FILE", help="validation rows (same formats); none: no evaluation")
    init.add_argument(
        "--reward", metavar="REF", help="path/file.py:fn, module:fn or a built-in name (default: exact_match)"
    )
    init.add_argument("--out", default="my_run.yaml", help="the config to write (default: my_run.yaml)")
    init.add_argument("overrides", nargs="*", metavar="key=value", help="written as given, over any guess")
    init.set_defaults(func=_init)
    docs = sub.add_parser("config-docs", help="print the configuration reference (Markdown)")
    docs.set_defaults(func=lambda _: print(_config_reference()) or 0)
    for name, (example, note) in EXAMPLES.items():
        sub.choices[name].formatter_class = argparse.RawDescriptionHelpFormatter
        reference = "every key: sluice config-docs (docs/config.md)"
        sub.choices[name].epilog = f"example:\n  {example}\n\n{note + '; ' if note else ''}{reference}"
    return parser


def _split_args(items: Sequence[str]) -> tuple[list[str], list[str]]:
    """Config files (merged in order: ``my_run.yaml plan.yaml``) and ``key=value`` overrides."""
    paths = []
    overrides = []
    for item in items:
        if item.startswith("resume="):  # `sluice train CONFIG resume=auto`: short for run.resume
            overrides.append(f"run.{item}")
        elif "=" in item:
            overrides.append(item)
        else:
            paths.append(item)
    return paths, overrides


def _train(args: argparse.Namespace) -> int:
    console = Console()
    cfg = load_config(*_split_args(args.args))
    task = _check_before_torch(cfg)
    if args.dry_run:
        from sluice.config.usage import unused_sections

        text = dump_config(cfg, unused_sections(cfg, task.env))
        console.print(text, end="", markup=False, highlight=False)
        return 0
    from sluice.runtime.run_lock import refuse_if_held
    from sluice.telemetry.console import run_console

    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    refuse_if_held(run_dir)  # a second driver: said before the model loads and before run.log opens
    with run_console(run_dir) as terminal:  # Ray's and libraries' lines: run.log
        return _run(cfg, console, terminal)


def _run(cfg: SluiceConfig, console: Console, terminal: TextIO) -> int:
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
        print(stopped, file=terminal, flush=True)
        return stopped.exit_code
    console.print(f"steps {result.steps} in {result.minutes:.1f} min; final model {result.final_model_dir}")
    if result.base_accuracy is None or result.final_accuracy is None:
        print("no evaluation (run.eval_every=0, or data.train_files without data.val_files)", flush=True)
    else:
        print(f"accuracy {100 * result.base_accuracy:.1f} -> {100 * result.final_accuracy:.1f}", flush=True)
    return 0


def _supervised(args: argparse.Namespace) -> int:
    """``sluice sft`` / ``sluice rm`` (``args.command``): the config (``--dry-run`` prints it), the
    checks before torch (a wrong key or model path costs a blink), the run and its summary."""
    console = Console()
    cfg = load_config(*_split_args(args.args))
    if args.dry_run:
        console.print(dump_config(cfg), end="", markup=False, highlight=False)
        return 0
    from sluice.engines.model_folder import check_model_dir
    from sluice.preflight import check_rm, check_sft
    from sluice.telemetry import TrainProgress

    sft = args.command == "sft"
    (check_sft if sft else check_rm)(cfg)
    check_model_dir(cfg.model.path or "")
    result: SftResult | RmResult
    with TrainProgress(0, args.command, cfg.run.progress, console) as bar:  # its total: once the rows are read
        if sft:
            from sluice.controller.sft import run_sft

            result = run_sft(cfg, progress=bar)
            named = (("val_loss", result.val_loss), ("accuracy", result.accuracy))
            scores = "  ".join(f"{k} {v:.4f}" for k, v in named if v is not None)
            scores = scores or "no evaluation (run.eval_every=0, or no data.val_files)"
        else:
            from sluice.controller.rm import run_rm

            result = run_rm(cfg, progress=bar)
            accuracy = result.val_accuracy
            scores = (
                f"val pairwise accuracy {accuracy:.4f}" if accuracy is not None else "no evaluation (no data.val_files)"
            )
    rows, model = ("rows", "final model") if sft else ("pairs", "reward model")
    dropped = f"; {result.filtered} {rows} over {args.command}.max_length dropped" if result.filtered else ""
    console.print(f"steps {result.steps} in {result.minutes:.1f} min; {model} {result.final_model_dir}{dropped}")
    print(scores, flush=True)
    return 0


def _eval(args: argparse.Namespace) -> int:
    cfg = load_config(None, [*args.overrides, f"model.path={args.model_dir}"])
    _check_before_torch(cfg)
    if args.data:
        from sluice.data import check_user_data

        check_user_data(cfg, reward_given=False, files="--data")
    from sluice.telemetry.console import run_console

    with run_console(Path(cfg.run.output_dir) / cfg.run.name):  # libraries' lines: the run dir's run.log
        return _evaluate(cfg, args.data)


def _evaluate(cfg: SluiceConfig, data: str | None) -> int:
    from sluice.rl_trainer import RLTrainer

    trainer = RLTrainer(cfg)
    trainer.init_engines(train=False)
    if data:
        trainer.load_eval_data(data)
    else:
        trainer.load_prompt_data()
    result = trainer.evaluate()
    what = data or "held-out"
    sampled = f", {result.samples} samples at T={cfg.eval.temperature}" if result.samples else ""
    print(f"{_scores(result, result.samples)}  ({result.count} {what} prompts, greedy{sampled})")
    if len(result.by_source) > 1 or data:
        for source, scores in result.by_source.items():
            print(f"  {source}: {_scores(scores, result.samples)}  ({scores.count} prompts)")
    buckets = "  ".join(f"{k} {100 * v.accuracy:.1f}" for k, v in result.by_bucket.items())
    if buckets:
        print(f"  by bucket: {buckets}")
    return 0


def _check_before_torch(cfg: SluiceConfig) -> TaskSpec:
    """A wrong ``model.path``, task name, agentic section or data setting is said before torch and
    transformers are imported (seconds); the run's built-in task."""
    from sluice.preflight import preflight

    if cfg.model.path:
        from sluice.engines.model_folder import check_model_dir

        check_model_dir(cfg.model.path)
    return preflight(cfg, reward_given=False)


def _scores(scores: EvalScores, k: int) -> str:
    text = f"accuracy {100 * scores.accuracy:.1f}"
    if scores.mean_at_k is not None and scores.pass_at_k is not None:
        text += f"  mean@{k} {100 * scores.mean_at_k:.1f}  pass@{k} {100 * scores.pass_at_k:.1f}"
    return text


def _bench(args: argparse.Namespace) -> int:
    load_config(None, args.overrides)  # fail fast on a bad override, before torch
    from sluice.bench.e2e import (
        DEFAULT_VARIANTS,
        VARIANTS,
        VLLM_VARIANTS,
        WAIT_VARIANTS,
        format_table,
        run_e2e,
        workload_overrides,
        write_json,
    )

    default = DEFAULT_VARIANTS if args.workload == "default" else WAIT_VARIANTS
    variants = [v.strip() for v in args.variants.split(",")] if args.variants else default
    if variants == ["vllm"]:
        variants = VLLM_VARIANTS
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"bench e2e --variants: unknown {unknown} (choose from {list(VARIANTS)})")
    from sluice.telemetry.console import run_console

    with run_console("runs/bench_e2e"):  # the variants' Ray and library lines: runs/bench_e2e/run.log
        overrides, mu = workload_overrides(args.workload, args.overrides, "runs/bench_e2e")
        if mu is not None:
            print(f"workload {args.workload}: μ = σ = {mu:.4f} s (median wall time of one generation turn, measured)")
        rows = run_e2e(overrides, variants=variants)
    print(format_table(rows))
    print(f"wrote {write_json(rows, args.out, overrides, args.workload, mu)}")
    return 0


def _trace(args: argparse.Namespace) -> int:
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


def _init(args: argparse.Namespace) -> int:
    from sluice.init import init_config

    result = init_config(args.model, args.data, args.out, args.val, args.reward, args.overrides)
    for guess in result.guesses:
        print(f"  {guess.key} = {guess.value!r}: {guess.why}")
    for line in result.checks:
        print(line)
    print(f"wrote {result.path}; next: sluice train {result.path} run.steps=2")
    return 0


def _config_reference() -> str:
    from sluice.config.reference import config_reference

    return config_reference()


_USER_ERRORS = {
    "sluice.dag.spec": "DagError",
    "sluice.data.readers": "DatasetError",
    "sluice.engines.model_folder": "ModelPathError",
    "sluice.runtime.run_lock": "RunDirBusy",
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
