"""The calculator as an OpenAI-client agent vs the built-in ``Env``: accuracy and wall time.

Trains ``examples/calculator/config.yaml`` (the ``Env``: episodes played in-process by the
episode runner) and ``examples/calculator_agent/config.yaml`` (the same task, warm start, token
stream and RL settings, but every model call goes through the OpenAI-compatible endpoint from
``agent.py``'s ``openai`` client) one after the other in one process, with the same overrides,
and reports each run's held-out greedy accuracy before and after, its training-loop seconds and
the agent's ratio to the ``Env`` (issue 25's acceptance: at least the ``Env``'s accuracy in at
most 1.5× its wall time). The warm start is built (or read from the cache) before either run is
timed. Prints a table, writes JSON. It measures; it asserts nothing.

    flock /tmp/bench.lock .venv/bin/python benchmarks/agent_vs_env.py [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from harness.report import write_results

from sluice import RLTrainer
from sluice.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"env": ROOT / "examples/calculator/config.yaml", "agent": ROOT / "examples/calculator_agent/config.yaml"}


def run(name: str, overrides: list[str], out_dir: str) -> dict[str, Any]:
    run_at = [f"run.output_dir={out_dir}", f"run.name={name}", "run.progress=false"]
    cfg = load_config(CONFIGS[name], [*overrides, *run_at])
    started = time.perf_counter()
    result = RLTrainer(cfg).fit()
    return {
        "variant": name,
        "steps": result.steps,
        "base_accuracy": result.base_accuracy,
        "final_accuracy": result.final_accuracy,
        "loop_s": round(result.loop_seconds, 1),
        "wall_s": round(time.perf_counter() - started, 1),
        "run_dir": str(result.run_dir),
        **engine_and_cpu(result.run_dir / "metrics.jsonl"),
    }


def engine_and_cpu(metrics: Path) -> dict[str, float]:
    """The run's last engine counters (decode steps, prefill forwards, generated tokens) and CPU
    seconds by process role (``cpu_other``: processes of no sluice role, the agents' among them)."""
    last: dict[str, float] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        last.update({k: v for k, v in record.items() if k.startswith(("engine_", "cpu_")) and isinstance(v, float)})
    keep = ("engine_steps", "engine_prefills", "engine_generated_tokens")
    return {k: v for k, v in last.items() if k in keep or (k.startswith("cpu_") and v >= 0.5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value for both runs")
    parser.add_argument("--out-dir", default="runs/agent_vs_env")
    parser.add_argument("--out", default="benchmarks/results/agent_vs_env.json")
    args = parser.parse_args()
    run("env", [*args.overrides, "run.steps=1", "run.eval_every=0"], args.out_dir + "/warmup")  # builds the warm start
    rows = [run(name, args.overrides, args.out_dir) for name in ("env", "agent")]
    env = rows[0]
    print(f"{'variant':<7} {'accuracy':>13} {'loop s':>7} {'wall s':>7} {'loop vs env':>11} {'steps':>6} {'cpu s':>6}")
    for row in rows:
        acc = f"{100 * (row['base_accuracy'] or 0):.1f}→{100 * (row['final_accuracy'] or 0):.1f}"
        ratio = row["loop_s"] / env["loop_s"] if env["loop_s"] else float("nan")
        steps, cpu = row.get("engine_steps", float("nan")), row.get("cpu_total", float("nan"))
        times = f"{row['loop_s']:>7.1f} {row['wall_s']:>7.1f}"
        print(f"{row['variant']:<7} {acc:>13} {times} {ratio:>10.2f}x {steps:>6.0f} {cpu:>6.1f}")
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
