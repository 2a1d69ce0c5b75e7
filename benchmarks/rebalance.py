"""Dynamic rebalancing on simulated replicas: response lengths grow 4x mid-run; sluice's
``Rebalancer`` (the rule of ``fleet.rebalance``, starting from 2 replicas) adding and removing
replicas through the real ``LLMProxy``, against every fixed replica count the rule may choose
(1 to its ``max_replicas``, the fixed splits a planner would consider) under the same shift.

Every row drives sluice's ``Controller``, ledger, ``LLMProxy`` and ``GroupRunner`` over
``SimEngine`` replicas on the virtual clock (``harness/rebalance_run.py``), so the numbers are exact
simulated seconds. Prints per-phase mean step times, the mean replicas held, the best fixed count
per phase and the rebalanced run's distance from it; writes JSON and a PNG of step time and
replica count against the step (fixed 2 replicas and the rebalancer).

    .venv/bin/python benchmarks/rebalance.py [--steps 30] [--shift-at 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, replace
from pathlib import Path

from harness.rebalance_run import RebalanceRun, run_with_shift

from sluice.schedule.rebalance import RebalanceRule
from sluice.sim.cost_model import TrainerCost
from sluice.sim.engine import LengthModel, SimEngineConfig
from sluice.sim.simulate import SimConfig

# A replica: 20 ms per decode iteration up to 16 running sequences, at most 64. The trainer is
# a fixed 5 s per step plus 0.2 ms per token: it sets the pace with 2 replicas at the short lengths.
ENGINE = SimEngineConfig(decode_s=0.02, knee=16, max_running=64, prefill_s_per_token=1e-4, load_s=0.5,
                         lengths=LengthModel(40, 0.3, 0.3))  # fmt: skip
TRAINER = TrainerCost(token_s=2e-4, microbatch_overhead_s=0.05, micro_batch_tokens=1024, step_s=5.0)
LONGER = LengthModel(160, 0.3, 0.3)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


PHASES = ("whole_run_s", "before_shift_s", "after_shift_s", "last_steps_s")


def phases(run: RebalanceRun, shift_at: int) -> dict[str, float]:
    rows = run.rows
    tail = max(len(rows) - shift_at, 1) // 2
    return {
        "whole_run_s": _mean([r.step_s for r in rows[1:]]),  # the first step is start-up
        "mean_replicas": _mean([r.replicas for r in rows]),
        "before_shift_s": _mean([r.step_s for r in rows[1:shift_at]]),
        "after_shift_s": _mean([r.step_s for r in rows[shift_at:]]),
        "last_steps_s": _mean([r.step_s for r in rows[-tail:]]),
        "last_train_s": _mean([r.train_s for r in rows[-tail:]]),
        "final_replicas": float(rows[-1].replicas),
    }


def best_fixed(results: dict[str, dict[str, float]]) -> dict[str, tuple[str, float]]:
    """Per phase, the fixed replica count with the shortest mean step, and that step."""
    fixed = {name: p for name, p in results.items() if name.startswith("fixed")}
    return {phase: min(((n, p[phase]) for n, p in fixed.items()), key=lambda np: np[1]) for phase in PHASES}


def plot(runs: dict[str, RebalanceRun], shift_at: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), dpi=120)
    ax = fig.add_subplot()
    for (name, run), color in zip(runs.items(), ("#E45756", "#4C78A8"), strict=True):
        steps, times = [r.step for r in run.rows], [r.step_s for r in run.rows]
        ax.plot(steps, times, marker="o", ms=2.5, lw=0.6, alpha=0.45, color=color)
        pairs = [(a + b) / 2 for a, b in itertools.pairwise(times)]  # async steps alternate
        ax.plot(steps[1:], pairs, lw=2.0, color=color, label=f"{name} (2-step mean)")
    balanced = runs["rebalancer"].rows
    ax.plot([r.step for r in balanced], [r.train_s for r in balanced], ls=":", color="#54A24B", label="trainer busy")
    ax.axvline(shift_at + 0.5, color="grey", ls="--", lw=0.8)
    low, high = ax.get_ylim()
    ax.text(shift_at + 0.7, low + 0.02 * (high - low), "lengths x4", color="grey", va="bottom")
    ax.set_xlabel("training step")
    ax.set_ylabel("step time (simulated s)")
    twin = ax.twinx()
    twin.step([r.step for r in balanced], [r.replicas for r in balanced], where="post", color="#4C78A8", alpha=0.4)
    twin.set_ylabel("rollout replicas (rebalancer)")
    twin.set_ylim(0, max(r.replicas for r in balanced) + 1)
    ax.legend(loc="upper left", frameon=False)
    fig.suptitle("Dynamic rebalancing on SimEngine replicas: response lengths grow 4x mid-run")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--shift-at", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/rebalance.json")
    parser.add_argument("--png", default="docs/images/rebalance.png")
    args = parser.parse_args()
    config = SimConfig(ENGINE, TRAINER, replicas=2, prompts_per_step=16, group_size=8, max_new_tokens=2000,
                       prompt_len=16, steps=args.steps, eta=1)  # fmt: skip
    rule = RebalanceRule()
    runs = {
        f"fixed {r} replicas": run_with_shift(replace(config, replicas=r), shift_at=args.shift_at, lengths=LONGER,
                                              rebalance=None)
        for r in range(rule.min_replicas, rule.max_replicas + 1)
    }  # fmt: skip
    runs["rebalancer"] = run_with_shift(config, shift_at=args.shift_at, lengths=LONGER, rebalance=rule)
    print(f"{'variant':<18} {'whole s':>8} {'before s':>9} {'after s':>8} {'last s':>7} {'trainer s':>9} "
          f"{'mean replicas':>13} {'at end':>6}")  # fmt: skip
    results = {}
    for name, run in runs.items():
        p = results[name] = phases(run, args.shift_at)
        print(
            f"{name:<18} {p['whole_run_s']:>8.2f} {p['before_shift_s']:>9.2f} {p['after_shift_s']:>8.2f} "
            f"{p['last_steps_s']:>7.2f} {p['last_train_s']:>9.2f} {p['mean_replicas']:>13.2f} "
            f"{p['final_replicas']:>6.0f}"
        )
    best = best_fixed(results)
    for phase, (name, seconds) in best.items():
        ratio = results["rebalancer"][phase] / seconds
        print(f"  {phase}: best fixed {name} {seconds:.2f} s; rebalancer {ratio:.3f}x ({(ratio - 1) * 100:+.1f} %)")
    for event in runs["rebalancer"].events:
        print(f"  step {event.step}: {event.change:+d} -> {event.replicas} replicas (step {event.step_s:.1f} s, "
              f"generation {event.generation_s:.1f} s vs training {event.train_s:.1f} s, "
              f"predicted {event.predicted_s:.1f} s)")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = {name: [asdict(r) for r in run.rows] for name, run in runs.items()}
    events = [asdict(e) for e in runs["rebalancer"].events]
    summary = {"args": vars(args), "phases": results, "best_fixed": best, "rows": rows, "events": events}
    out.write_text(json.dumps(summary, indent=2))
    shown = {name: runs[name] for name in ("fixed 2 replicas", "rebalancer")}
    print(f"wrote {out} and {plot(shown, args.shift_at, Path(args.png))}")


if __name__ == "__main__":
    main()
