"""``sluice init``: on verl's parquet schema with a chat model, a flat JSONL with other column
names and a ``datasets`` folder it guesses the mapping, says why, checks the rows and writes a
config that ``sluice train`` runs unchanged (two steps, in-process)."""

import json
import random

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from sluice.cli import main
from sluice.config import load_config
from tiny import add_chat_template

pytestmark = pytest.mark.integration

DIGITS = ["".join(random.Random(k).choice("0123456789") for _ in range(2 + k % 4)) for k in range(8)]
SMALL = ["rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8", "reward.pool_size=0"]
"""Overrides written into the config as given: a run small enough for a test."""


def _verl(tmp_path) -> str:
    rows = [{"data_source": "rev", "prompt": [{"role": "user", "content": d}], "ability": "digits",
             "reward_model": {"style": "rule", "ground_truth": d[::-1]}, "extra_info": {"index": k}}
            for k, d in enumerate(DIGITS)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    return "train.parquet"


def _flat(tmp_path) -> str:
    rows = [{"question": d + ">", "solution": int(d[::-1]), "level": len(d)} for d in DIGITS]
    (tmp_path / "flat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "flat.jsonl"


def _saved(tmp_path) -> str:
    datasets.Dataset.from_list([{"problem": d + ">", "target": d[::-1]} for d in DIGITS]).save_to_disk(
        str(tmp_path / "saved")
    )
    return "saved"


FORMATS = {
    "verl_parquet": (_verl, {"prompt_key": "prompt", "answer_key": "reward_model.ground_truth"}),
    "flat_jsonl": (_flat, {"prompt_key": "question", "answer_key": "solution"}),
    "datasets_folder": (_saved, {"prompt_key": "problem", "answer_key": "target"}),
}


def _init(tmp_path, tiny_task_model, fmt, *extra):
    make, _ = FORMATS[fmt]
    model = tiny_task_model
    if fmt == "verl_parquet":  # chat messages need a chat template
        model = add_chat_template(tiny_task_model, tmp_path / "chat_model")
    data = make(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def score(response, *, answer, **_):\n    return response == answer\n")
    return main(["init", "--model", str(model), "--data", data, *extra, *SMALL])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_init_guesses_the_mapping_says_why_and_writes_a_loadable_config(tmp_path, tiny_task_model, monkeypatch,
                                                                         capsys, fmt):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert _init(tmp_path, tiny_task_model, fmt, "--reward", "my_rewards.py:score") == 0
    out = capsys.readouterr().out
    config = load_config("my_run.yaml")
    for key, value in FORMATS[fmt][1].items():
        assert getattr(config.data, key) == value
        assert f"data.{key} = {value!r}: " in out  # said, with why
    assert config.rollout.group_size == 2 and config.run.steps == 4  # 8 rows, 2 a step: one pass
    assert config.reward.fn == f"{tmp_path / 'my_rewards.py'}:score"
    assert "reward on row 1 with its own answer as the response: 1" in out
    assert "checked 8 of 8 rows of " in out and "wrote my_run.yaml" in out
    text = (tmp_path / "my_run.yaml").read_text()
    assert "prompt_key:" in text and "  # " in text  # commented
    if fmt == "verl_parquet":
        assert "'<bos>" in out and "list of chat messages (verl's schema)" in out  # rendered by the template


def test_the_written_configs_train_two_steps_unchanged(tmp_path, tiny_task_model, monkeypatch, capsys):
    """Each format's config, as ``sluice init`` wrote it, trains two steps (local backend, one
    process); ``sluice train my_run.yaml run.steps=2`` plus only where its outputs go."""
    for fmt in FORMATS:
        folder = tmp_path / fmt
        folder.mkdir()
        monkeypatch.chdir(folder)
        assert _init(folder, tiny_task_model, fmt, "run.backend=local", "run.mode=sync", "run.threads=1") == 0
        args = ["train", "my_run.yaml", "run.steps=2", "run.progress=false", "tracking.plot=false"]
        assert main(args) == 0, fmt
        records = [json.loads(line) for line in (folder / "runs" / "my_run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2], fmt
    assert capsys.readouterr().out.count("steps 2 in ") == 3


def test_init_names_the_columns_when_it_finds_no_prompt_and_writes_nothing(tmp_path, tiny_task_model, monkeypatch,
                                                                           capsys):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "odd.jsonl").write_text(json.dumps({"x": "12>", "y": "21"}) + "\n")
    assert main(["init", "--model", str(tiny_task_model), "--data", "odd.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "no prompt column among x, y" in err and "data.prompt_key=COLUMN" in err
    assert not (tmp_path / "my_run.yaml").exists()
    assert main(["init", "--model", str(tiny_task_model), "--data", "odd.jsonl", "data.prompt_key=x",
                 "data.answer_key=y"]) == 0  # fmt: skip
    assert yaml.safe_load((tmp_path / "my_run.yaml").read_text())["data"]["prompt_key"] == "x"


def test_the_validation_rows_are_checked_with_the_same_mapping(tmp_path, tiny_task_model, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _flat(tmp_path)
    (tmp_path / "val.jsonl").write_text(json.dumps({"question": "12>", "solution": "21"}) + "\n")
    args = ["init", "--model", str(tiny_task_model), "--data", "flat.jsonl", *SMALL]
    assert main([*args, "--val", "val.jsonl"]) == 0
    config = load_config("my_run.yaml")
    assert config.data.val_files == ("val.jsonl",) and config.run.eval_every == 20  # evaluated, the default
    assert "checked 1 of 1 rows of val.jsonl" in capsys.readouterr().out
    (tmp_path / "other.jsonl").write_text(json.dumps({"prompt": "12>", "answer": "21"}) + "\n")
    assert main([*args, "--val", "other.jsonl", "--out", "other.yaml"]) == 2
    assert "other.jsonl line 1: no prompt at 'question'" in capsys.readouterr().err
    assert not (tmp_path / "other.yaml").exists()
