"""``sluice bench e2e --workload``: a waiting-bound workload's wait μ is measured, not chosen — the
median wall time of one generation turn in a short sync pilot run of the same task — and every
row then runs with it (the pilot, on the tiny model)."""

from __future__ import annotations

import json

from sluice.bench.e2e import PILOT_STEPS, workload_overrides
from sluice.config import load_config
from tiny import tiny_run_overrides


def test_a_waiting_workload_measures_its_wait_from_a_pilot_run(tiny_task_model, tmp_path):
    overrides = [*tiny_run_overrides(tiny_task_model, tmp_path, "w"), "rollout.max_new_tokens=8", "reward.pool_size=0"]
    full, mu = workload_overrides("reward-wait", overrides, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "pilot" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "train"]) == PILOT_STEPS
    measured = next(r for r in records if r["kind"] == "proxy")["request_s_median"]
    assert mu == measured > 0 and full[-1] == f"reward.latency_s={mu:.4f}"
    assert load_config(None, full).reward.latency_s == round(mu, 4)
    assert workload_overrides("default", overrides, tmp_path) == (overrides, None)
