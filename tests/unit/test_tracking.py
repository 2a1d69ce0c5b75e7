"""The run's trackers (TensorBoard, wandb offline), sample summaries and ``sluice plot``, read back
with the libraries' own readers. wandb runs offline and silent: nothing touches the network."""

import json
import struct
import sys
from pathlib import Path

import pytest

from sluice.api import Sample
from sluice.cli import main
from sluice.config import ConfigError, TrackingConfig
from sluice.telemetry.plot import plot_run, read_metrics, series
from sluice.telemetry.samples import sample_rows, summarize_samples
from sluice.telemetry.trackers import SAMPLE_COLUMNS, WANDB_RUN_ID, open_trackers
from wandb_log import config_of, history_rows, read_records

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")


def _row(step: int, **extra):
    return {"step": step, "group_id": 3, "version": step - 1, "staleness": 0, "reward": 0.5,
            "prompt": "12>", "response": "21|x\ny", **extra}  # fmt: skip


def _wandb_records(run_dir: Path) -> list:
    import wandb

    wandb.teardown()  # the service writes the run file's tail after finish(): wait for it
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, list(run_dir.rglob("*"))
    return [r for f in files for r in read_records(f)]


def test_tensorboard_scalars_and_sample_text_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = open_trackers(TrackingConfig(trackers=("tensorboard",)), tmp_path, {}, resume=False)
    trackers.log_record("eval", 0, {"kind": "eval", "step": 0, "accuracy": 0.25, "note": "text", "nan": None})
    trackers.log_record("train", 1, {"kind": "train", "step": 1, "reward_mean": 0.5, "flag": True})
    trackers.log_record("train", 2, {"kind": "train", "step": 2, "reward_mean": 0.75})
    trackers.log_samples(2, [_row(2)])
    trackers.close()

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["eval/accuracy", "train/reward_mean"]  # numbers only
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(0, 0.25)]
    (text,) = acc.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and table.splitlines()[0] == "| " + " | ".join(SAMPLE_COLUMNS) + " |"
    assert table.splitlines()[2] == "| 2 | 3 | 1 | 0 | 0.5 | 12> | 21\\|x ⏎ y |"  # one row per sample


def test_wandb_offline_run_holds_config_scalars_and_sample_table(tmp_path):
    tracking = TrackingConfig(trackers=("wandb",), wandb_project="proj")
    trackers = open_trackers(tracking, tmp_path, {"run": {"steps": 2}, "tracking": {"plot": True}}, resume=False)
    trackers.log_record("train", 1, {"kind": "train", "step": 1, "reward_mean": 0.5, "loss": -1.5})
    trackers.log_samples(1, [_row(1), _row(1, group_id=4)])
    trackers.log_record("eval", 2, {"kind": "eval", "step": 2, "accuracy": 0.75})
    trackers.close()

    records = _wandb_records(tmp_path)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in history_rows(records)]
    assert {"step": 1, "train/reward_mean": 0.5, "train/loss": -1.5} in rows
    assert {"step": 2, "eval/accuracy": 0.75} in rows
    config = config_of(records)
    assert config["run"] == {"steps": 2} and config["tracking"] == {"plot": True}
    assert any(r.WhichOneof("record_type") == "exit" and r.exit.exit_code == 0 for r in records)
    (table_file,) = tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert [row[1] for row in table["data"]] == [3, 4] and table["data"][0][-1] == "21|x\ny"


def test_wandb_resume_continues_the_same_run_and_a_failed_run_says_so(tmp_path):
    tracking = TrackingConfig(trackers=("wandb",))
    first = open_trackers(tracking, tmp_path, {}, resume=False)
    first.log_record("train", 1, {"reward_mean": 0.5})
    first.close()
    run_id = (tmp_path / WANDB_RUN_ID).read_text().strip()
    again = open_trackers(tracking, tmp_path, {}, resume=True)
    again.log_record("train", 1, {"reward_mean": 0.25})  # a redone step is still logged
    again.close(failed=True)
    assert (tmp_path / WANDB_RUN_ID).read_text().strip() == run_id
    files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    records = _wandb_records(tmp_path)
    values = [row["train/reward_mean"] for row in history_rows(records) if "train/reward_mean" in row]
    assert values == [0.5, 0.25]
    assert sorted(r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit") == [0, 1]


@pytest.mark.parametrize(("tracker", "module"), [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")])
def test_a_missing_tracker_package_names_the_option_and_the_extra(tmp_path, monkeypatch, tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=rf"tracking.trackers: '{tracker}' needs .*pip install 'sluice\[track\]'"):
        open_trackers(TrackingConfig(trackers=(tracker,)), tmp_path, {}, resume=False)


def test_no_trackers_writes_nothing(tmp_path):
    trackers = open_trackers(TrackingConfig(), tmp_path, {}, resume=False)
    trackers.log_record("train", 1, {"reward_mean": 0.5})
    trackers.log_samples(1, [_row(1)])
    trackers.close()
    assert list(tmp_path.iterdir()) == []


def _sample(group: int, k: int, version: int) -> Sample:
    return Sample(f"{group}-{k}", group, (1, 2), (3, 4, 5), (0.0,) * 3, (version + 1, version, version), (1, 1, 1),
                  reward=float(k))  # fmt: skip


class _Decoder:
    """Token 1 is special (a chat template's role marker): shown only with skip_special_tokens=False."""

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join("abcdef"[t] for t in token_ids if not (skip_special_tokens and t == 1))


def test_samples_are_spread_over_the_step_and_decoded_with_their_staleness():
    step = [_sample(g, k, version=g) for g in range(4) for k in range(4)]
    chosen = summarize_samples(step, 3)
    assert [s.uid for s in chosen] == ["0-0", "1-1", "2-2"]  # indices 0, 5, 10 of 16
    assert [s.uid for s in summarize_samples(step[:2], 5)] == ["0-0", "0-1"]
    rows = sample_rows(4, chosen, _Decoder())
    assert [(r["version"], r["staleness"], r["reward"]) for r in rows] == [(0, 3, 0.0), (1, 2, 1.0), (2, 1, 2.0)]
    assert rows[0]["prompt"] == "bc" and rows[0]["response"] == "def" and rows[0]["group_id"] == 0  # prompt: as seen
    assert set(SAMPLE_COLUMNS) <= set(rows[0])


def _write_metrics(run_dir: Path, *, evals: bool) -> None:
    records = [{"kind": "eval", "step": 0, "accuracy": 0.2}] if evals else []
    for step in range(1, 6):
        train = {"reward_mean": step / 10, "response_len_mean": 8.0 + step, "tokens_per_s": 100.0 * step}
        records.append({"kind": "train", "step": step, **train, "staleness_mean": 0.5, "sample_staleness_mean": 0.25})
    per_source = {"accuracy/gsm": 0.6, "pass@4/gsm": 0.9}  # the overall curves only: these stay in the logs
    records += [{"kind": "eval", "step": 5, "accuracy": 0.6, "pass@4": 0.9, **per_source}] if evals else []
    records.append({"kind": "cpu", "cpu_total": 3.0})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width > 500 and height > 300 and len(data) > 20_000


def test_plot_reads_every_series_and_draws_a_png(tmp_path):
    _write_metrics(tmp_path, evals=True)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert series(records, "eval", ("accuracy", "pass@")) == {"accuracy": [(0, 0.2), (5, 0.6)], "pass@4": [(5, 0.9)]}
    assert series(records, "train", ("tokens_per_s",))["tokens_per_s"][-1] == (5, 500.0)
    _assert_png(plot_run(tmp_path))
    assert (tmp_path / "plot.png").is_file()


def test_plot_without_eval_records_and_through_the_cli(tmp_path, capsys):
    _write_metrics(tmp_path / "run", evals=False)
    out = tmp_path / "figs" / "curves.png"
    assert main(["plot", str(tmp_path / "run"), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    _assert_png(out)
    assert main(["plot", str(tmp_path / "run")]) == 0
    _assert_png(tmp_path / "run" / "plot.png")


def test_plot_errors_name_the_file_and_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n\n{"kind": "train", oops}\n')
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "metrics.jsonl line 3: not JSON" in err and len(err.splitlines()) == 1
