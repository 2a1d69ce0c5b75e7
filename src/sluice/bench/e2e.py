"""``sluice bench e2e``: sync vs streaming vs asynchronous training on the same sample budget.

Full runs of the same config in one process, differing only in the schedule and placement:
``sync`` (the barrier schedule, one process); streaming at η = 0 (overlap inside a step only);
η = 1; η = 4; η = 1 with two data-parallel trainer ranks; and sync on one torch thread (the
least CPU the computation itself needs). Each row reports **trained** response tokens per second
of training loop, loop wall time, the trainer's idle fraction, the exposed weight-sync time, the
realised staleness histogram, final held-out accuracy, and the CPU seconds of every process of
the run by role (``telemetry/cpu.py``), whose quotient by the cores bounds what any scheduling of
the same work could gain on sync (``cpu_bound_s``, ``≤ vs sync``). The columns, and why the
bound is what it is: README, "``sluice bench e2e``".

``--workload`` picks what is trained: ``default`` (the config as given), or a waiting-bound one
(ROLL Flash's simulated-environment setting): ``agentic-wait`` (every env step of the calculator
task waits μ ± μ seconds, ``agentic.env_latency_s``, with ``rollout.reprefill: false``) or
``reward-wait`` (every reward call waits so, ``reward.latency_s``), where μ is **measured** (the
median wall time of one generation turn, from a short sync pilot run), printed and kept in the
JSON; those rows are sync and async η = 1, 2, 4. Prints a table and writes JSON. It measures; it
asserts nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sluice.config import load_config

VARIANTS: dict[str, list[str]] = {
    "sync": ["run.mode=sync", "run.backend=local"],
    "stream η=0": ["run.mode=async", "rollout.max_staleness=0"],
    "async η=1": ["run.mode=async", "rollout.max_staleness=1"],
    "async η=2": ["run.mode=async", "rollout.max_staleness=2"],
    "async η=4": ["run.mode=async", "rollout.max_staleness=4"],
    "async η=1 dp2": ["run.mode=async", "rollout.max_staleness=1", "resources.trainer.ranks=2", "trainer.strategy=ddp"],
    "sync 1 thread": ["run.mode=sync", "run.backend=local", "run.threads=1"],
    "async η=1 1proc": [
        "run.mode=async",
        "rollout.max_staleness=1",
        "run.backend=local",
        "run.threads=1",
        "rollout.reprefill=false",
    ],
    "vllm sync": ["run.mode=sync", "run.backend=local", "rollout.engine=vllm"],
    "vllm async η=1": ["run.mode=async", "rollout.max_staleness=1", "rollout.engine=vllm"],
    "vllm async η=1 bcast": [
        "run.mode=async",
        "rollout.max_staleness=1",
        "rollout.engine=vllm",
        "fleet.weight_transfer=broadcast",
    ],
}
"""``async η=1 1proc``: the one-process placement (rollout on the event loop, trainer in a thread, one
torch thread each): no Ray actors, queue actors or weight registry to pay for on one node; an
in-flight weight load keeps the running rows' KV cache (``rollout.reprefill``: no re-prefill).
The ``vllm`` rows generate with vLLM (run them in ``.venv-vllm``; set ``vllm.*`` by override):
weights through the shared-memory block, or with ``bcast`` over the broadcast group into vLLM's
workers (``fleet.weight_transfer: broadcast``)."""
VLLM_VARIANTS = ["async η=1", "vllm sync", "vllm async η=1", "vllm async η=1 bcast"]
"""``--variants vllm``: the built-in engine's η = 1 row beside vLLM's (docs/engines.md)."""


DEFAULT_VARIANTS = ["sync", "stream η=0", "async η=1", "async η=4", "async η=1 dp2", "sync 1 thread", "async η=1 1proc"]
WAIT_VARIANTS = ["sync", "async η=1", "async η=2", "async η=4"]
WORKLOADS: dict[str, tuple[list[str], str | None]] = {
    "default": ([], None),
    "agentic-wait": (["task.name=calculator", "rollout.reprefill=false"], "agentic.env_latency_s"),
    "reward-wait": ([], "reward.latency_s"),
}
"""Workload -> (its overrides, the option its measured wait μ goes to; ``None``: no wait)."""
PILOT_STEPS = 3

BASE_AND_FINAL = 1_000_000
"""``run.eval_every`` of the variants: the base and final evaluations only (the accuracy column)."""


def workload_overrides(workload: str, overrides: list[str], out_dir: str | Path) -> tuple[list[str], float | None]:
    """The workload's overrides (before the user's) with its measured wait, and that μ (``None``:
    the workload has no wait)."""
    extra, option = WORKLOADS[workload]
    if option is None:
        return [*extra, *overrides], None
    mu = measure_turn_s([*extra, *overrides], out_dir)
    return [*extra, *overrides, f"{option}={mu:.4f}"], mu


def measure_turn_s(overrides: list[str], out_dir: str | Path) -> float:
    """μ: the median wall time of one generation turn (one request) of the task here, from a
    ``PILOT_STEPS``-step sync run without any wait (the proxy's ``request_s_median``)."""
    from sluice.rl_trainer import RLTrainer

    pilot = [*overrides, "run.mode=sync", "run.backend=local", f"run.steps={PILOT_STEPS}", "run.eval_every=0"]
    cfg = load_config(None, [*pilot, "run.progress=false", f"run.output_dir={out_dir}", "run.name=pilot"])
    result = RLTrainer(cfg).fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return float(next(r for r in records if r["kind"] == "proxy")["request_s_median"])


def run_e2e(
    overrides: list[str], out_dir: str | Path = "runs/bench_e2e", variants: list[str] | None = None
) -> list[dict[str, Any]]:
    """Run each variant with ``overrides`` on top; returns one row per variant."""
    from sluice.rl_trainer import RLTrainer

    rows = []
    for name in variants or DEFAULT_VARIANTS:
        slug = name.replace(" ", "_").replace("η=", "eta")
        cfg = load_config(
            None,
            [
                f"run.eval_every={BASE_AND_FINAL}",
                "run.progress=false",
                f"run.output_dir={out_dir}",
                *overrides,
                *VARIANTS[name],
                f"run.name={slug}",
            ],
        )
        result = RLTrainer(cfg).fit()
        rows.append(_row(name, result))
    for row in rows:
        row["cpu_bound_vs_first"] = bound_vs_first(row, rows[0])
    return rows


def _row(name: str, result: Any) -> dict[str, Any]:
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    trace = next((r for r in records if r["kind"] == "trace"), {})
    fates = next((r for r in records if r["kind"] == "fates"), {})
    cpu = next((r for r in records if r["kind"] == "cpu"), {})
    trained = sum(r["trained_tokens"] for r in train)
    staleness = {k.removeprefix("staleness_"): v for k, v in fates.items() if k.startswith("staleness_")}
    return {
        "variant": name,
        "steps": result.steps,
        "trained_tokens": trained,
        "loop_s": round(result.loop_seconds, 2),
        "trained_tokens_per_s": round(trained / max(result.loop_seconds, 1e-9), 1),
        "trainer_idle_fraction": trace.get("trainer_idle_fraction"),
        "exposed_weight_sync_s": round(sum(r.get("exposed_weight_sync_s", 0.0) for r in train), 3),
        "staleness": staleness or {"0": float(len(train))},
        "cpu_s": cpu.get("cpu_total"),
        "cpu_bound_s": round(cpu["cpu_total"] / cpu["cores"], 2) if "cpu_total" in cpu else None,
        "cpu_by_role": {k.removeprefix("cpu_"): v for k, v in cpu.items() if k.startswith("cpu_") and k != "cpu_total"},
        "weight_sync_s_per_version": _mean(r.get("weight_sync_s") for r in train),
        "weight_load_s_per_version": _mean(r.get("weight_load_s") for r in train),
        "logprob_gap_mean": _mean(r.get("logprob_gap_mean") for r in train),
        "logprob_gap_max": max((r["logprob_gap_max"] for r in train if "logprob_gap_max" in r), default=None),
        "base_accuracy": result.base_accuracy,
        "final_accuracy": result.final_accuracy,
        "run_dir": str(result.run_dir),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["trained_tokens_per_s"] if rows else 1.0
    head = (
        f"{'variant':<20} {'trained tok/s':>13} {'vs sync':>7} {'loop s':>7} {'idle':>5} {'sync s':>6} "
        f"{'cpu s':>6} {'bound s':>7} {'≤ vs sync':>9} {'load s/v':>8} {'lp gap':>7}  {'staleness':<22} {'acc':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        idle = r["trainer_idle_fraction"]
        hist = " ".join(f"{k}:{int(v)}" for k, v in sorted(r["staleness"].items(), key=lambda kv: int(kv[0])))
        base_acc, final_acc = r["base_accuracy"], r["final_accuracy"]
        acc = "n/a" if base_acc is None or final_acc is None else f"{100 * base_acc:.1f}→{100 * final_acc:.1f}"
        lines.append(
            f"{r['variant']:<20} {r['trained_tokens_per_s']:>13,.0f} {r['trained_tokens_per_s'] / base:>6.2f}x "
            f"{r['loop_s']:>7.1f} {'n/a' if idle is None else f'{100 * idle:.0f}%':>5} "
            f"{r['exposed_weight_sync_s']:>6.2f} {_num(r.get('cpu_s')):>6} {_num(r.get('cpu_bound_s')):>7} "
            f"{_ratio(bound_vs_first(r, rows[0])):>9} {_num(r.get('weight_load_s_per_version'), 4):>8} "
            f"{_num(r.get('logprob_gap_mean'), 4):>7}  "
            f"{hist:<22} {acc:>11}"
        )
    return "\n".join(lines)


def bound_vs_first(row: dict[str, Any], first: dict[str, Any]) -> float | None:
    """The most ``row`` could reach against the first row (sync) with its CPU work unchanged: its
    trained tokens over its CPU bound (every core busy all the loop, nothing waited for), in units
    of the first row's trained tokens per second (``None``: no CPU record)."""
    bound = row.get("cpu_bound_s")
    if not bound or not first["trained_tokens_per_s"]:
        return None
    return float(row["trained_tokens"] / bound / first["trained_tokens_per_s"])


def _mean(values: Any) -> float | None:
    """The mean of the values that are there (``None`` when none is)."""
    present = [float(v) for v in values if v is not None]
    return round(sum(present) / len(present), 6) if present else None


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def write_json(
    rows: list[dict[str, Any]],
    path: str | Path,
    overrides: list[str],
    workload: str = "default",
    mu: float | None = None,
) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"workload": workload, "wait_mean_s": mu, "wait_sd_s": mu, "overrides": overrides, "rows": rows}
    out.write_text(json.dumps(body, indent=2))
    return out
