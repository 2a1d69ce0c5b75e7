"""``sluice sft``'s rows: each format read and rendered, the loss tokens checked token by token, and
each error a user meets said in one line naming the file and row (``data/conversations.py``)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.config.data import DataConfig
from sluice.config.sft import SftConfig
from sluice.data import DatasetError, read_rows
from sluice.data.conversations import TOO_LONG, ConversationRenderer
from tiny import CHAT_TEMPLATE as TEMPLATE
from tiny import chat_tokenizer

CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "ok?"},
    {"role": "assistant", "content": "ya"},
]


def renderer(template=TEMPLATE, max_length=100, **sft):
    tok = chat_tokenizer(template)
    return ConversationRenderer(tok, DataConfig(), SftConfig(**sft), max_length)


def trained(r, example):
    """The trained tokens of ``example`` as text, one string per contiguous run."""
    runs, current = [], []
    for i, t in zip(example.ids, example.train, strict=True):
        if t:
            current.append(r.tokenizer.convert_ids_to_tokens(i))
        elif current:
            runs.append("".join(current))
            current = []
    return runs + (["".join(current)] if current else [])


def test_every_assistant_turn_and_only_it_carries_the_loss_token_by_token():
    r = renderer()
    ex = r.example({"messages": CHAT}, "chats.jsonl line 1")
    tokens = r.tokenizer.convert_ids_to_tokens(list(ex.ids))
    assert "".join(tokens) == "<u>hi<a>yo<eos><u>ok?<a>ya<eos>"
    expected = [0] * 8 + [1, 1, 1] + [0] * 9 + [1, 1, 1]  # y o <eos> ... y a <eos>
    assert list(ex.train) == expected


def test_train_on_completion_keeps_the_last_turn_and_all_every_token_but_the_first():
    last = renderer(train_on="completion").example({"messages": CHAT}, "row 1")
    assert trained(renderer(), last) == ["ya<eos>"]
    everything = renderer(train_on="all").example({"messages": CHAT}, "row 1")
    assert everything.train[0] == 0 and all(everything.train[1:])


def test_a_generation_marked_template_uses_its_assistant_mask():
    marked = (
        "{% for m in messages %}<{{ m['role'][0] }}>"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    r = renderer(template=marked)
    assert r.marked
    ex = r.example({"messages": CHAT}, "row 1")
    assert trained(r, ex) == ["yo<eos>", "ya<eos>"]
    assert list(ex.train) == list(renderer().example({"messages": CHAT}, "row 1").train)


def _write(tmp_path, name, rows):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    elif name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet", "rows_folder"])
def test_each_file_format_and_row_format_renders_the_same_conversation(tmp_path, name):
    conversational = [{"messages": CHAT[:2]}]
    trl_prompt_completion = [{"prompt": [CHAT[0]], "completion": [CHAT[1]]}]
    strings = [{"prompt": "hi", "completion": "yo"}]
    r = renderer()
    want = r.example({"messages": CHAT[:2]}, "row")
    for rows in (conversational, trl_prompt_completion, strings):
        got = r.build(read_rows(_write(tmp_path, name, rows))).examples
        assert [(e.ids, e.train) for e in got] == [(want.ids, want.train)]


def test_verl_sft_parquet_reads_dotted_prompt_and_response_keys(tmp_path):
    rows = [{"extra_info": {"question": "hi", "answer": "yo"}, "data_source": "x"}]
    tok = chat_tokenizer()
    r = ConversationRenderer(
        tok, DataConfig(prompt_key="extra_info.question"), SftConfig(response_key="extra_info.answer"), 100
    )
    (ex,) = r.build(read_rows(_write(tmp_path, "verl.parquet", rows))).examples
    assert trained(r, ex) == ["yo<eos>"]


def test_untemplated_strings_train_the_response_and_eos():
    r = renderer(template=None)
    ex = r.example({"prompt": "ab", "completion": "cd"}, "row 1")
    assert r.tokenizer.convert_ids_to_tokens(list(ex.ids)) == ["<bos>", "a", "b", "c", "d", "<eos>"]
    assert list(ex.train) == [0, 0, 0, 1, 1, 1]


def _one_line_error(r, rows, tmp_path, line=2):
    with pytest.raises(DatasetError) as err:
        r.build(read_rows(_write(tmp_path, "bad.jsonl", rows)))
    message = str(err.value)
    assert "\n" not in message and f"{tmp_path / 'bad.jsonl'} line {line}:" in message
    return message


def test_a_row_without_an_assistant_turn_is_one_line_naming_it(tmp_path):
    rows = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "hi"}]}]
    assert "no assistant turn" in _one_line_error(renderer(), rows, tmp_path)


def test_a_template_that_drops_assistant_content_is_one_line_naming_it(tmp_path):
    dropping = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] if m['role'] != 'assistant' else '' }}"
        "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    message = _one_line_error(renderer(template=dropping), [{"messages": CHAT}], tmp_path, line=1)
    assert "drops the content of assistant message" in message


def test_conversational_rows_without_a_chat_template_are_one_line_naming_the_row(tmp_path):
    rows = [{"prompt": "hi", "completion": "yo"}, {"messages": CHAT}]
    assert "no chat template" in _one_line_error(renderer(template=None), rows, tmp_path)


def test_rows_over_the_context_are_dropped_and_counted_or_refused(tmp_path):
    rows = [{"prompt": "hi", "completion": "yo"}, {"prompt": "hi", "completion": "y" * 40}]
    kept = renderer(max_length=20).build(read_rows(_write(tmp_path, "bad.jsonl", rows)))
    assert len(kept.examples) == 1 and kept.filtered[TOO_LONG] == 1
    assert "over sft.max_length (20)" in _one_line_error(renderer(max_length=20, long_rows="error"), rows, tmp_path)


def test_a_row_with_nothing_to_train_on_is_one_line_naming_it(tmp_path):
    rows = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}]
    assert "no token to train on" in _one_line_error(
        renderer(template=TEMPLATE.replace("eos_token", "''")), rows, tmp_path
    )
