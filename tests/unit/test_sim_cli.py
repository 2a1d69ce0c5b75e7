"""``sluice plan`` and ``sluice simulate`` end to end on small cases: tables, JSON, trace."""

from __future__ import annotations

import json

from sluice.cli import main

SMALL = ["--model", "qwen2.5-1.5b", "--device", "A100", "--batch", "4", "--group-size", "4",
         "--prompt-len", "32", "--median-len", "60", "--max-new-tokens", "400", "--steps", "3"]  # fmt: skip


def test_simulate_prints_the_result_and_writes_trace_and_json(tmp_path, capsys):
    trace, out = tmp_path / "sim.json", tmp_path / "result.json"
    args = ["simulate", *SMALL, "--rollout-devices", "2", "--train-devices", "2", "--micro-batch-tokens", "2048"]
    assert main([*args, "--trace", str(trace), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step" in printed and "trainer busy" in printed
    result = json.loads(out.read_text())
    assert result["replicas"] == 2 and result["step_s"] > 0 and len(result["step_times"]) == 3
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"decode", "train_microbatch"} <= names


def test_plan_prints_ranked_configurations(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *SMALL, "--devices", "3", "--replica-sizes", "1", "--micro-batch-tokens", "2048",
                 "--json", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "2 configurations fit" in printed
    ranked = json.loads(out.read_text())["ranked"]
    assert ranked and ranked == sorted(ranked, key=lambda r: r["step_s"])
    assert {r["rollout_devices"] for r in ranked} <= {1, 2}


def test_configurations_that_cannot_run_are_one_line_errors(capsys):
    assert main(["simulate", *SMALL, "--rollout-devices", "3", "--replica-devices", "2", "--train-devices", "1"]) == 2
    assert "multiple of --replica-devices" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-32b", "--device", "910B", "--devices", "2", "--replica-sizes", "1"]) == 2
    assert "does not fit" in capsys.readouterr().err
