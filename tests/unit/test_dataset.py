import pytest

from sluice.tasks.dataset import DatasetError, PromptStream, read_jsonl, to_prompt_items
from sluice.tasks.tiny_model import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("0123456789>")


def test_rows_become_items(tokenizer):
    items = to_prompt_items([{"prompt": "12>", "answer": "21"}], tokenizer)
    assert items[0].prompt_ids[0] == tokenizer.bos_token_id
    assert items[0].fields == {"answer": "21"}


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([], "dataset is empty"),
        ([{"prompt": "", "answer": "1"}], "row 0: field 'prompt' must be a non-empty string"),
        ([{"prompt": "1>", "answer": "1"}, {"answer": "2"}], "row 1: field 'prompt'"),
        ([{"prompt": "1>"}], "row 0: missing field(s) 'answer'"),
        ([{"prompt": "1x>", "answer": "1"}], "row 0: field 'prompt' has characters outside"),
        (["just a string"], "row 0: expected a mapping"),
    ],
)
def test_bad_rows_name_the_row(tokenizer, rows, needle):
    with pytest.raises(DatasetError) as err:
        to_prompt_items(rows, tokenizer)
    assert needle in str(err.value)


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1>", "answer": "1"}\n\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"d.jsonl:3: expected a JSON object"):
        read_jsonl(path)
    path.write_text('{"prompt": "1>"\n')
    with pytest.raises(DatasetError, match=r"d.jsonl:1: not valid JSON"):
        read_jsonl(path)
    with pytest.raises(DatasetError, match="not found"):
        read_jsonl(tmp_path / "none.jsonl")


def test_prompt_stream_covers_each_epoch_once_and_is_seeded(tokenizer):
    items = to_prompt_items([{"prompt": f"{i}>", "answer": str(i)} for i in range(10)], tokenizer)
    a, b = PromptStream(items, seed=3), PromptStream(items, seed=3)
    first = [it.index for it in a.take(10)]
    assert sorted(first) == list(range(10))
    assert first == [it.index for it in b.take(10)]
    assert sorted(it.index for it in a.take(10)) == list(range(10))
    assert [it.index for it in PromptStream(items, seed=4).take(10)] != first
