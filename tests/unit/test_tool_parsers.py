"""Tool-call parsers: Hermes / Qwen-style blocks and the tiny calculator format round-trip to
OpenAI ``tool_calls`` and back through a chat template; malformed calls stay text and are counted."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from sluice.rollout.envs import TINY_CHAT_TEMPLATE
from sluice.rollout.tool_parsers import TOOL_PARSERS, parse_calculator, parse_hermes, template_messages
from sluice.tasks import TASKS
from sluice.tasks.tiny_model import build_char_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
QWEN_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}"
)
"""A Qwen-style template (written here): assistant calls rendered as Hermes blocks."""


def _args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


def test_hermes_calls_parse_to_openai_tool_calls():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    text += '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    turn = parse_hermes(text, TOOLS, "ep7")
    assert turn.content == "Let me check." and turn.malformed == 0
    assert [c["id"] for c in turn.tool_calls] == ["ep7_0", "ep7_1"]
    assert all(c["type"] == "function" and c["function"]["name"] == "get_weather" for c in turn.tool_calls)
    assert [_args(c) for c in turn.tool_calls] == [{"city": "Oslo", "days": 2}, {"city": "Rome"}]
    only_calls = parse_hermes('<tool_call>{"name": "f", "arguments": {}}</tool_call>', TOOLS)
    assert only_calls.content is None and len(only_calls.tool_calls) == 1


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a"',  # never closed (length cap)
    ],
)
def test_malformed_hermes_calls_stay_text_and_are_counted(block):
    text = f"before {block}"
    turn = parse_hermes(text, TOOLS)
    assert turn.tool_calls == () and turn.malformed == 1
    assert turn.content == text.strip()


def test_malformed_call_beside_a_good_one():
    good = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    turn = parse_hermes(f"{good} <tool_call>oops</tool_call>", TOOLS)
    assert len(turn.tool_calls) == 1 and turn.malformed == 1 and turn.content == "<tool_call>oops</tool_call>"


def test_hermes_round_trip_through_a_qwen_style_template():
    tok = PreTrainedTokenizerFast(tokenizer_object=build_char_tokenizer("ab")._tokenizer)
    calls = parse_hermes('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', TOOLS)
    message = {"role": "assistant", "content": calls.content, "tool_calls": list(calls.tool_calls)}
    text = tok.apply_chat_template(template_messages([message]), chat_template=QWEN_STYLE, tokenize=False)
    body = text.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    again = parse_hermes(body, TOOLS)
    assert [(c["function"]["name"], _args(c)) for c in again.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert again.content is None and again.malformed == 0


def test_calculator_format_round_trips_through_the_tiny_template():
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    turn = parse_calculator("c37*48", tools, "e1")
    assert turn.content is None and turn.malformed == 0
    (call,) = turn.tool_calls
    assert call["id"] == "e1_0" and call["function"]["name"] == "calculator" and _args(call) == {"expression": "37*48"}
    tok = build_char_tokenizer(TASKS["calculator"].alphabet, chat_template=TINY_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "37*48"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert tok.apply_chat_template(template_messages(messages), tokenize=False) == "<bos>37*48>c37*48<eos>"
    assert parse_calculator("a1776", tools).content == "a1776"
    assert parse_calculator("c37*48", []).tool_calls == ()  # no tool offered: text
    bare = parse_calculator("c", tools)  # as the env: an empty expression, which the tool answers "err"
    assert bare.content is None and _args(bare.tool_calls[0]) == {"expression": ""} and bare.malformed == 0


def test_registry_and_bad_arguments():
    assert set(TOOL_PARSERS) == {"hermes", "calculator", "none"}
    assert TOOL_PARSERS["none"]("c1*2", TOOLS, "x").content == "c1*2"
    bad = [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\]: tool call arguments are not JSON"):
        template_messages(bad)
