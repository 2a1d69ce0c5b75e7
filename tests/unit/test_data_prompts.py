"""Rows → PromptItems: mapping (verl's schema, dotted paths), answers, chat rendering, lengths."""

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import LlamaConfig

from sluice.config import ConfigError, DataConfig, load_config
from sluice.data import (
    DatasetError,
    PromptBuilder,
    PromptLimit,
    PromptStream,
    check_user_data,
    in_memory,
    prompt_limit,
    read_rows,
)
from sluice.rewards import exact_match_reward
from sluice.tasks.tiny_model import build_char_tokenizer
from tiny import TINY_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("0123456789>-")


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = build_char_tokenizer("0123456789>-")
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def _build(rows, tokenizer, limit=None, keep_columns=False, **data):
    bound = PromptLimit(limit) if limit is not None else None
    return PromptBuilder(DataConfig(**data), tokenizer, bound).build(in_memory(rows), keep_columns=keep_columns)


def test_builtin_rows_keep_their_columns_and_the_raw_prompt_ids(tokenizer):
    items = _build([{"prompt": "12>", "answer": "21", "bucket": "short"}], tokenizer, keep_columns=True).items
    assert items[0].prompt_ids == tuple(tokenizer("12>")["input_ids"])  # today's ids: <bos> + characters
    assert items[0].prompt_ids[0] == tokenizer.bos_token_id
    assert items[0].fields == {"answer": "21", "bucket": "short", "data_source": "default"}


def test_verl_parquet_with_chat_messages(tmp_path, chat_tokenizer):
    rows = [
        {
            "data_source": "digits/rev",
            "prompt": [{"role": "user", "content": "12"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "21"},
            "extra_info": {"split": "train", "index": 0},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    builder = PromptBuilder(DataConfig(system_prompt="9"), chat_tokenizer)
    item = builder.build(read_rows(tmp_path / "train.parquet")).items[0]
    assert item.prompt == "<bos>9-12>"  # the system prompt, the user turn, the generation prompt
    assert item.prompt_ids == tuple(chat_tokenizer("<bos>9-12>", add_special_tokens=False)["input_ids"])
    assert item.prompt_ids.count(chat_tokenizer.bos_token_id) == 1  # the template's, not a second one
    assert item.fields == {"answer": "21", "data_source": "digits/rev"}


def test_a_string_prompt_becomes_one_user_message_under_a_template(chat_tokenizer):
    assert _build([{"prompt": "12", "answer": "21"}], chat_tokenizer).items[0].prompt == "<bos>12>"
    off = _build([{"prompt": "12>", "answer": "21"}], chat_tokenizer, chat_template="off").items[0]
    assert off.prompt == "12>" and off.prompt_ids[0] == chat_tokenizer.bos_token_id


def test_mapped_schema_with_dotted_paths(tmp_path, tokenizer):
    rows = [{"q": {"text": "34>"}, "sol": {"final": 43}, "meta": {"src": "mine", "tests": ["a", "b"]}}]
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n")
    data = DataConfig(
        prompt_key="q.text", answer_key="sol.final", data_source_key="meta.src", fields={"tests": "meta.tests"}
    )
    item = PromptBuilder(data, tokenizer).read([str(tmp_path / "d.jsonl")]).items[0]
    assert item.prompt == "34>"
    assert item.fields == {"answer": "43", "data_source": "mine", "tests": ["a", "b"]}


def test_numbers_as_answers_become_strings_an_exact_match_can_hit(tokenizer):
    items = _build(
        [{"prompt": "1>", "answer": 42}, {"prompt": "2>", "answer": 72.0}, {"prompt": "3>", "answer": 0.5}], tokenizer
    ).items
    assert [it.fields["answer"] for it in items] == ["42", "72", "0.5"]
    assert exact_match_reward("42", **items[0].fields) == 1.0


CHAT = [{"role": "user", "content": "1"}]


@pytest.mark.parametrize(
    ("rows", "data", "needle"),
    [
        ([], {}, "dataset is empty: no rows"),
        ([{"prompt": "1>", "answer": "1"}, {"prompt": "", "answer": "2"}], {},
         "row 2: the prompt at 'prompt' is empty"),
        ([{"prompt": "1>", "answer": "1"}, {"answer": "2"}], {}, "row 2: no prompt at 'prompt'"),
        ([{"prompt": "1>"}], {}, "row 1: no answer: neither 'answer' nor 'reward_model.ground_truth'"),
        ([{"prompt": "1x>", "answer": "1"}], {}, "row 1: the prompt has characters outside"),
        (["just a string"], {}, "row 1: expected a mapping"),
        ([{"prompt": "1>", "answer": [1]}], {}, "row 1: the answer at 'answer' must be a string or a number, got list"),
        ([{"prompt": "1>", "answer": True}], {},
         "row 1: the answer at 'answer' must be a string or a number, got bool"),
        ([{"prompt": "1>", "x": {"y": 1}}], {"answer_key": "x.z"}, "row 1: no answer at 'x.z'"),
        ([{"prompt": "1>", "answer": "1"}], {"fields": {"tests": "extra_info.tests"}},
         "row 1: no field 'tests' at 'extra_info.tests'"),
        ([{"prompt": CHAT, "answer": "1"}], {},
         "row 1: the prompt at 'prompt' is a list of chat messages, but the chat template is off"),
        ([{"prompt": [{"role": "user"}], "answer": "1"}], {},
         "row 1: message 1 of the prompt at 'prompt' is not a {role, content} pair"),
        ([{"prompt": 7, "answer": "1"}], {},
         "row 1: the prompt at 'prompt' must be a non-empty string or a non-empty list"),
    ],
)  # fmt: skip
def test_bad_rows_name_the_row_one_based(tokenizer, rows, data, needle):
    with pytest.raises(DatasetError) as err:
        _build(rows, tokenizer, **data)
    assert needle in str(err.value)


def test_chat_settings_that_cannot_work_are_config_errors(tokenizer):
    with pytest.raises(ConfigError, match=r"data.chat_template: 'on', but the model's tokenizer has no chat template"):
        PromptBuilder(DataConfig(chat_template="on"), tokenizer)
    with pytest.raises(ConfigError, match=r"data.system_prompt: needs a chat template"):
        PromptBuilder(DataConfig(system_prompt="9"), tokenizer)


def test_long_prompts_are_filtered_and_counted_or_stop_the_run(tokenizer, caplog):
    rows = [{"prompt": "12>", "answer": "1"}, {"prompt": "123456>", "answer": "1"}, {"prompt": "1>", "answer": "1"}]
    kept = _build(rows, tokenizer, limit=4)  # <bos> + 3 characters fit, <bos> + 7 do not
    assert [it.prompt for it in kept.items] == ["12>", "1>"]
    assert [it.index for it in kept.items] == [0, 2]
    assert kept.filtered == Counter(too_long=1)
    assert "1 of 3 prompts longer than the prompt limit (4 tokens, data.max_prompt_length) filtered" in caplog.text
    with pytest.raises(DatasetError, match=r"row 2: the prompt is 8 tokens, over the prompt limit \(4 tokens, data"):
        _build(rows, tokenizer, limit=4, long_prompts="error")
    with pytest.raises(DatasetError, match=r"every prompt is longer than the prompt limit \(4 tokens"):
        _build(rows[1:2], tokenizer, limit=4)


def test_prompt_limit_fits_the_model_context(tmp_path):
    LlamaConfig(max_position_embeddings=64).save_pretrained(tmp_path)
    derived = "the model's max_position_embeddings (64) - rollout.max_new_tokens (24)"
    assert prompt_limit(DataConfig(), tmp_path, 24) == PromptLimit(40, derived)  # said where the 40 came from
    assert prompt_limit(DataConfig(max_prompt_length=30), tmp_path, 24) == PromptLimit(30, "data.max_prompt_length")
    with pytest.raises(
        ConfigError,
        match=r"data.max_prompt_length \(50\) \+ rollout.max_new_tokens \(24\) must fit the model's "
        r"max_position_embeddings \(64, .*config.json\)",
    ):
        prompt_limit(DataConfig(max_prompt_length=50), tmp_path, 24)
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \(null\) \+ rollout.max_new_tokens \(64\)"):
        prompt_limit(DataConfig(), tmp_path, 64)


def test_user_data_needs_an_explicit_response_cap_and_reward():
    user = ["data.train_files=rows.jsonl"]
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: must be set with data.train_files"):
        check_user_data(load_config(None, user), reward_given=True)
    with pytest.raises(ConfigError, match=r"reward: data.train_files needs a reward"):
        check_user_data(load_config(None, [*user, "rollout.max_new_tokens=8"]), reward_given=False)
    check_user_data(load_config(None, [*user, "rollout.max_new_tokens=8", "reward.name=exact_match"]), False)
    check_user_data(load_config(None, [*user, "rollout.max_new_tokens=8"]), reward_given=True)
    check_user_data(load_config(None, []), reward_given=False)  # the built-in task brings both
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: must be set with --data"):
        check_user_data(load_config(None, []), reward_given=False, files="--data")  # sluice eval --data FILE


def test_prompt_stream_covers_each_epoch_once_and_is_seeded(tokenizer):
    items = _build([{"prompt": f"{i}>", "answer": str(i)} for i in range(10)], tokenizer).items
    a, b = PromptStream(items, seed=3), PromptStream(items, seed=3)
    first = [it.index for it in a.take(10)]
    assert sorted(first) == list(range(10))
    assert first == [it.index for it in b.take(10)]
    assert sorted(it.index for it in a.take(10)) == list(range(10))
    assert [it.index for it in PromptStream(items, seed=4).take(10)] != first


def test_a_bare_yaml_on_or_off_is_the_chat_template_word(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  chat_template: on\n")  # YAML 1.1: a boolean
    assert load_config(path, []).data.chat_template == "on"
    assert load_config(None, ["data.chat_template=off"]).data.chat_template == "off"


@pytest.mark.parametrize(
    ("row", "data", "needle"),
    [
        (
            {"question": "1>", "answer": "1"},
            {},
            "no prompt at 'prompt' (row keys: question, answer); set data.prompt_key=question",
        ),
        ({"prompt": "1>", "solution": "1"}, {}, "(row keys: prompt, solution); set data.answer_key=solution"),
        ({"promt": "1>", "answer": "1"}, {}, "set data.prompt_key=promt"),
        (
            {"prompt": "1>", "answer": "1", "tests": "x"},
            {"fields": {"tests": "extra.tests"}},
            "set data.fields.tests=tests",
        ),
    ],
)
def test_a_missing_column_names_the_mapping_key_to_set(tokenizer, row, data, needle):
    with pytest.raises(DatasetError) as err:
        _build([row], tokenizer, **data)
    assert needle in str(err.value)
