"""``sluice plan`` and ``sluice simulate``: argument parsing and rendering for the planner and
the pipeline simulator (the work is ``sim.planner.plan`` and ``sim.simulate.simulate``).

    sluice plan --model qwen2.5-7b --device H100 --devices 16 --batch 64 --eta 1 --top 5
    sluice plan --model qwen2.5-7b --device H20 --train-device H800 --devices 16 --objective cost
    sluice plan --model qwen2.5-7b --device H100 --devices 16 --out plan.yaml  # sluice train my_run.yaml plan.yaml
    sluice simulate --model qwen2.5-7b --device H100 --rollout-devices 8 --replica-devices 2 \\
        --train-devices 8 --mode async --eta 2 --trace sim.json --gantt sim.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sluice.config import ConfigError
from sluice.sim.cost_model import DEVICES, MODELS
from sluice.sim.engine import LengthModel
from sluice.sim.planner import Candidate, Cluster, Plan, Workload, cost_per_hour, plan, run_keys, sim_config
from sluice.sim.simulate import MODES, SimResult, simulate


def add_commands(sub: Any) -> None:
    """Register ``plan`` and ``simulate`` on the CLI's subparsers."""
    p = sub.add_parser("plan", help="search the rollout / training split for the shortest step or best cost")
    _workload_args(p)
    p.add_argument("--devices", type=int, required=True, help="devices to split between rollout and training")
    p.add_argument("--objective", choices=["step", "cost"], default="step", help="step time or samples per dollar")
    p.add_argument("--replica-sizes", default="1,2,4,8", help="devices per rollout replica to try")
    p.add_argument("--micro-batch-tokens", default="4096,16384,65536", help="trainer micro-batch budgets to try")
    p.add_argument("--top", type=int, default=5)
    p.add_argument(
        "--out", metavar="PLAN.yaml",
        help="write the best split as sluice train keys (sluice train my_run.yaml PLAN.yaml runs it)",
    )  # fmt: skip
    p.set_defaults(func=_plan)
    s = sub.add_parser("simulate", help="simulate one pipeline configuration (step time, bubbles, Gantt)")
    _workload_args(s)
    s.add_argument("--rollout-devices", type=int, required=True)
    s.add_argument("--replica-devices", type=int, default=1, help="devices per rollout replica")
    s.add_argument("--train-devices", type=int, required=True)
    s.add_argument("--micro-batch-tokens", type=int, default=16384)
    s.add_argument("--trace", help="write the simulated timeline (Chrome trace JSON) here")
    s.add_argument("--gantt", help="draw the simulated timeline to this PNG")
    s.set_defaults(func=_simulate)


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-7b")
    p.add_argument("--device", choices=sorted(DEVICES), default="H100", help="rollout (and training) device kind")
    p.add_argument("--train-device", choices=sorted(DEVICES), help="training device kind (heterogeneous pair)")
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--median-len", type=float, default=1000.0, help="median response tokens (log-normal)")
    p.add_argument("--prompt-sigma", type=float, default=0.6, help="log-spread of lengths between prompts")
    p.add_argument("--sample-sigma", type=float, default=0.6, help="log-spread within a prompt's samples")
    p.add_argument("--max-new-tokens", type=int, default=8192)
    p.add_argument("--mode", choices=MODES, default="async")
    p.add_argument("--eta", type=int, default=1, help="staleness bound in async mode")
    p.add_argument("--weight-update", choices=["interrupt", "defer", "staggered"], default="interrupt")
    p.add_argument("--reward-latency", type=float, default=0.0, help="seconds per reward call")
    p.add_argument("--steps", type=int, default=5, help="simulated steps (the first is left out of the mean)")
    p.add_argument("--json", help="write the result as JSON here")


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(
        MODELS[args.model],
        prompts_per_step=args.batch,
        group_size=args.group_size,
        prompt_len=args.prompt_len,
        lengths=LengthModel(args.median_len, args.prompt_sigma, args.sample_sigma),
        max_new_tokens=args.max_new_tokens,
        mode=args.mode,
        eta=args.eta,
        weight_update=args.weight_update,
        reward_latency_s=args.reward_latency,
    )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _plan(args: argparse.Namespace) -> int:
    cluster = Cluster(
        DEVICES[args.device],
        args.devices,
        train_device=DEVICES[args.train_device] if args.train_device else None,
        replica_sizes=_ints(args.replica_sizes),
        micro_batch_tokens=_ints(args.micro_batch_tokens),
    )
    try:
        result = plan(_workload(args), cluster, args.objective, steps=args.steps)
    except ValueError as err:  # nothing fits: a user error, one line
        raise ConfigError(f"plan: {err}") from err
    print(format_plan(result, args.top))
    if args.out:
        print(f"wrote {write_plan(args.out, _workload(args), cluster, result, args)}")
    if args.json:
        rows = [{**_row(r.candidate, r.result), "cost_per_hour": r.cost_per_hour,
                 "samples_per_dollar": r.samples_per_dollar} for r in result.ranked]  # fmt: skip
        _write(args.json, {"args": vars(args), "enumerated": result.enumerated, "ranked": rows})
    return 0


def write_plan(path: str, workload: Workload, cluster: Cluster, result: Plan, args: argparse.Namespace) -> Path:
    """The best candidate as a config file of ``sluice train`` keys, with what it was chosen for."""
    import yaml

    best = result.ranked[0]
    command = " ".join(["sluice plan", *(f"--{k.replace('_', '-')} {v}" for k, v in _given(args).items())])
    head = (
        f"# written by: {command}\n"
        f"# the best of {len(result.ranked)} simulated splits ({args.objective}): {best.candidate.label()}\n"
        f"# simulated step {best.result.step_s:.2f} s, ${best.cost_per_hour:.1f}/h; merge it after the run's own\n"
        f"# config: sluice train my_run.yaml {Path(path).name}\n"
    )
    out = Path(path)
    out.write_text(head + yaml.safe_dump(run_keys(workload, cluster, best.candidate), sort_keys=False))
    return out


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's own arguments (not the output paths or the handler)."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "out", "json", "top") and v is not None}


def format_plan(result: Plan, top: int) -> str:
    lines = [
        f"{result.enumerated} configurations fit, {len(result.ranked)} simulated (the rest bounded out), "
        f"{len(result.skipped)} do not fit",
        f"{'#':>2} {'rollout':>7} {'replicas':>9} {'train':>5} {'micro-batch':>11} {'step s':>8} "
        f"{'gen busy':>8} {'train busy':>10} {'$/h':>7} {'samples/$':>9}",
    ]
    for i, r in enumerate(result.ranked[:top], 1):
        c, s = r.candidate, r.result
        lines.append(
            f"{i:>2} {c.rollout_devices:>7} {f'{c.replicas}x{c.replica_devices}':>9} {c.train_devices:>5} "
            f"{c.micro_batch_tokens:>11} {s.step_s:>8.2f} {s.generation_utilisation:>8.0%} "
            f"{s.trainer_utilisation:>10.0%} {r.cost_per_hour:>7.1f} {r.samples_per_dollar:>9.0f}"
        )
    return "\n".join(lines)


def _simulate(args: argparse.Namespace) -> int:
    if args.rollout_devices % args.replica_devices:
        raise ConfigError(f"--rollout-devices {args.rollout_devices} is not a multiple of --replica-devices")
    cluster = Cluster(DEVICES[args.device], args.rollout_devices + args.train_devices,
                      train_device=DEVICES[args.train_device] if args.train_device else None)  # fmt: skip
    cand = Candidate(args.rollout_devices, args.train_devices, args.replica_devices, args.micro_batch_tokens)
    try:
        config = sim_config(_workload(args), cluster, cand, steps=args.steps)
    except ValueError as err:  # the model or micro-batch does not fit
        raise ConfigError(f"simulate: {err}") from err
    result = simulate(config)
    row = _row(cand, result)
    print(
        f"{cand.label()}: step {result.step_s:.2f} s, {result.samples_per_s:.1f} samples/s, "
        f"${cost_per_hour(cluster, cand):.1f}/h\n"
        f"generation busy {result.generation_utilisation:.0%} (bubble {result.generation_bubble:.0%}), "
        f"trainer busy {result.trainer_utilisation:.0%} (bubble {result.trainer_bubble:.0%}), "
        f"exposed weight sync {result.exposed_sync_s:.2f} s/step, staleness {result.staleness}"
    )
    if args.trace:
        from sluice.telemetry.trace import write_chrome_trace

        print(f"wrote {write_chrome_trace(args.trace, result.events)}")
    if args.gantt:
        from sluice.telemetry.gantt import render_gantt

        print(f"wrote {render_gantt(result.events, args.gantt, title=cand.label())}")
    if args.json:
        _write(args.json, {"args": vars(args), **row})
    return 0


def _row(cand: Candidate, result: SimResult) -> dict[str, Any]:
    return {**vars(cand), "replicas": cand.replicas, **result.summary(), "step_times": list(result.step_times)}


def _write(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({k: v for k, v in data.items() if k != "func"}, f, indent=2, default=str)
