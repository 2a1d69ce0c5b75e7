"""Each input format reads into the same rows; each bad file is one DatasetError naming file and line/row."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.data import DatasetError, read_rows

ROWS = [
    {"prompt": "12>", "answer": "21", "extra": {"n": 1}},
    {"prompt": "345>", "answer": "543", "extra": {"n": 2}},
]


def test_every_format_reads_the_same_rows(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    for name in ("d.jsonl", "d.json", "d.parquet", "saved", "dict"):
        assert read_rows(tmp_path / name).rows == ROWS, name
    assert read_rows(tmp_path / "dict").where(1) == f"{tmp_path / 'dict' / 'train'} row 2"


def test_jsonl_rows_are_named_by_their_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    rows = read_rows(path)
    assert [rows.where(k) for k in range(2)] == [f"{path} line 1", f"{path} line 3"]


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("d.jsonl", b'{"prompt": "1>"}\n\n[1, 2]\n', "d.jsonl line 3: expected a JSON object, got list"),
        ("d.jsonl", b'{"prompt": "1>"\n', "d.jsonl line 1: not valid JSON"),
        ("d.jsonl", b'{"prompt": "1>"}\n{"prompt": "caf\xe9"}\n', "d.jsonl line 2: not UTF-8 text (byte 0xe9"),
        ("d.json", b'[{"prompt": "1>"},\n "x"]', "d.json row 2: expected a JSON object, got str"),
        ("d.json", b'[{"prompt": "1>"},\n {"prompt": "\xff"}]', "d.json line 2: not UTF-8 text (byte 0xff)"),
        ("d.json", b'{"prompt": "1>"}', "d.json: expected a JSON list of row objects, got dict"),
        ("d.json", b'[{"prompt": "1>"},\n {]', "d.json line 2: not valid JSON"),
        ("d.csv", b"prompt\n1>\n", "d.csv: unknown format '.csv'"),
        ("d.parquet", b"not parquet", "d.parquet: not a readable parquet file"),
    ],
)
def test_bad_files_name_file_and_line(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatasetError) as err:
        read_rows(tmp_path / name)
    assert needle in str(err.value)


def test_missing_paths_and_folders_that_are_no_dataset(tmp_path):
    with pytest.raises(DatasetError, match=r"dataset file not found: .*none.jsonl"):
        read_rows(tmp_path / "none.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: a folder, but not one written by datasets' save_to_disk"):
        read_rows(tmp_path / "empty")
    splits = datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS), "dev": datasets.Dataset.from_list(ROWS)})
    splits.save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(DatasetError, match=r"without a 'train' split \(splits: dev, test\); name one split's folder"):
        read_rows(tmp_path / "nosplit")
    assert read_rows(tmp_path / "nosplit" / "test").rows == ROWS
