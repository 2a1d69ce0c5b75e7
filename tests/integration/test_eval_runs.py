"""Evaluation inside a run and through ``sluice eval``, on a tiny real model.

``run.eval_every=0`` (or an empty evaluation set) runs no evaluation at all; otherwise the base,
every ``run.eval_every`` steps and the final evaluation each log an ``eval`` record (overall, per
``data_source``, sampled mean@k / pass@k) and an ``eval`` span on the timeline.
"""

import json
import logging
from dataclasses import replace

import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.cli import main
from sluice.config import load_config
from tiny import tiny_run_overrides

pytestmark = pytest.mark.integration

SMALL = ["rollout.max_new_tokens=12", "reward.pool_size=0", "task.eval_prompts=6", "run.backend=local"]


def _trainer(model_dir, out, name, *overrides):
    config = load_config(None, [*tiny_run_overrides(model_dir, out, name), *SMALL, *overrides])
    trainer = RLTrainer(config, reward=length_reward)
    trainer.init_engines()
    trainer.load_prompt_data()
    return trainer


def _records(run_dir, kind):
    return [
        r for line in (run_dir / "metrics.jsonl").read_text().splitlines() if (r := json.loads(line))["kind"] == kind
    ]


def _eval_spans(run_dir):
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    return [e for e in events if e["name"] == "eval" and e["ph"] == "X"]


def _no_evaluation(*args, **kwargs):
    raise AssertionError("the evaluation set was generated")


def test_eval_every_zero_runs_no_evaluation(tiny_task_model, tmp_path, monkeypatch):
    monkeypatch.setattr("sluice.rollout.worker.evaluate_async", _no_evaluation)  # local backend: in-process
    result = _trainer(tiny_task_model, tmp_path, "no-eval", "run.eval_every=0", "run.steps=1").fit()
    assert result.base_accuracy is None and result.final_accuracy is None
    assert _records(result.run_dir, "eval") == [] and len(_records(result.run_dir, "train")) == 1
    assert _eval_spans(result.run_dir) == []


def test_an_empty_evaluation_set_runs_none_and_says_why(tiny_task_model, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("sluice.rollout.worker.evaluate_async", _no_evaluation)
    trainer = _trainer(tiny_task_model, tmp_path, "empty", "run.steps=1")
    trainer.eval_items = []
    with caplog.at_level(logging.WARNING, logger="sluice.controller.training"):
        result = trainer.fit()
    assert result.base_accuracy is None and _records(result.run_dir, "eval") == []
    assert "no evaluation: the evaluation set is empty" in caplog.text


def test_evaluations_per_source_with_samples_in_metrics_and_trace(tiny_task_model, tmp_path):
    trainer = _trainer(
        tiny_task_model, tmp_path, "sources", "run.steps=2", "run.eval_every=1", "eval.samples=2", "eval.max_prompts=5"
    )
    trainer.eval_items = [
        replace(item, fields={**item.fields, "data_source": "even" if item.index % 2 == 0 else "odd"})
        for item in trainer.eval_items
    ]
    result = trainer.fit()
    evals = _records(result.run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 1, 2]  # base, after step 1, final
    for record in evals:
        assert record["count"] == 5 and record["samples"] == 2
        assert {"accuracy/even", "accuracy/odd", "mean@k/even", "pass@k/odd", "mean@k", "pass@k"} <= set(record)
        assert not any(key.startswith("accuracy/default") for key in record)
        assert 0.0 <= record["mean@k"] <= 1.0 and record["accuracy"] <= 1.0
    assert (result.base_accuracy, result.final_accuracy) == (evals[0]["accuracy"], evals[-1]["accuracy"])
    spans = _eval_spans(result.run_dir)
    assert len(spans) == 3 and all(s["args"]["prompts"] == 5 and s["args"]["samples"] == 2 for s in spans)


def test_sluice_eval_on_a_users_file_prints_overall_and_per_source(tiny_task_model, tmp_path, capsys):
    data = tmp_path / "val.jsonl"
    rows = [("12>", "21", "a"), ("345>", "543", "b"), ("6>", "6", "a")]
    data.write_text("".join(json.dumps({"prompt": p, "answer": x, "data_source": s}) + "\n" for p, x, s in rows))
    args = ["eval", str(tiny_task_model), "--data", str(data), "eval.samples=4", "reward.name=exact_match"]
    assert main([*args, "reward.pool_size=0", "rollout.max_new_tokens=6", "run.threads=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("accuracy ") and "mean@4 " in lines[0] and "pass@4 " in lines[0]
    assert f"(3 {data} prompts, greedy, 4 samples at T=1.0)" in lines[0]
    assert lines[1].startswith("  a: accuracy ") and lines[1].endswith("(2 prompts)")
    assert lines[2].startswith("  b: accuracy ") and lines[2].endswith("(1 prompts)")
    assert not any("bucket" in line for line in lines)  # a user's rows: no toy-task buckets


def test_a_run_without_evaluation_checkpoints_and_resumes(tiny_task_model, tmp_path):
    off = ["run.eval_every=0", "run.mode=sync"]
    _trainer(tiny_task_model, tmp_path, "resumed", *off, "run.steps=1", "run.checkpoint_every=1").fit()
    result = _trainer(tiny_task_model, tmp_path, "resumed", *off, "run.steps=2", "run.resume=auto").fit()
    assert result.steps == 2 and result.base_accuracy is None and result.final_accuracy is None
    assert [r["step"] for r in _records(result.run_dir, "train")] == [1, 2] and not _records(result.run_dir, "eval")
