"""``examples/qwen_tools_agent``: its Qwen-style chat template on the gsm8k_style BPE tokenizer
renders prompts that extend each other across a tool round trip, and its unmodified OpenAI-tools
agent, driven through the endpoint by a scripted engine that samples a ``<tool_call>`` block,
gets ``tool_calls``, answers with a ``tool`` message, and leaves a token-exact trajectory."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from fakes import ScriptedTurnsEngine
from gsm8k_example import load
from qwen_tools_example import EXAMPLE
from qwen_tools_example import load as example
from sluice.api import PromptItem, SamplingParams
from sluice.rewards import math_verify_reward
from sluice.rollout.agent_runner import AgentEpisodeRunner
from sluice.rollout.agent_session import ChatModel, SessionLimits
from sluice.rollout.tool_parsers import TOOL_PARSERS

TEMPLATE = (EXAMPLE / "chat_template.jinja").read_text()
QUESTION = "Tom buys 3 bags of 4 apples. How many apples does he have? Put the final answer in \\boxed{}."
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3*4"}}\n</tool_call>'
ANSWER = "He has 3*4 = 12 apples. The answer is \\boxed{12}."


AGENT = example("agent")


@pytest.fixture(scope="module")
def tokenizer():
    """The gsm8k_style example's BPE tokenizer (trained here on a small corpus) with the template."""
    corpus = [QUESTION, ANSWER, "Sara has 25 marbles and gives away 7. The answer is \\boxed{18}."] * 20
    tok = load("make_model").train_tokenizer(corpus, vocab_size=300)
    tok.chat_template = TEMPLATE
    return tok


def _render(tok, messages, generation: bool = True) -> str:
    return tok.apply_chat_template(messages, tools=AGENT.TOOLS, add_generation_prompt=generation, tokenize=False)


def test_the_template_renders_qwen_style_turns_that_extend_each_other(tokenizer):
    call = {"id": "c0", "type": "function", "function": {"name": "calculate", "arguments": {"expression": "3*4"}}}
    chat = [{"role": "user", "content": QUESTION}]
    first = _render(tokenizer, chat)
    assert first.startswith("<|im_start|>system\n# Tools\n") and first.endswith("<|im_start|>assistant\n")
    assert json.dumps(AGENT.TOOLS[0]) in first and "<tool_call>" in first  # schema and call format
    chat += [{"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c0", "content": "12"}, {"role": "tool", "content": "ok"}]  # fmt: skip
    second = _render(tokenizer, chat)
    assert second.startswith(first + CALL + "<|im_end|>\n")  # the assistant turn as the model wrote it
    assert second.endswith(
        "<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )  # consecutive tool results share one user turn
    chat += [{"role": "assistant", "content": "So:", "tool_calls": [call, call]}]
    third = _render(tokenizer, chat, generation=False)
    assert third.startswith(second) and third.endswith("So:\n" + CALL + "\n" + CALL + "<|im_end|>\n")
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in (first, second, third)]
    assert ids[1][: len(ids[0])] == ids[0] and ids[2][: len(ids[1])] == ids[1]  # tokens extend too
    plain = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # no tools: the gsm8k_style prompt
    with pytest.raises(Exception, match="unknown role"):
        _render(tokenizer, [{"role": "critic", "content": "x"}])


def test_an_unmodified_tools_agent_round_trips_a_tool_call_token_exactly(tokenizer):
    end = tokenizer.eos_token_id
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    engine = ScriptedTurnsEngine([[*encode(CALL), end], [*encode(ANSWER), end]])
    limits = SessionLimits(max_turns=4, max_context=1024, turn_tokens=96,
                           params=SamplingParams(96, 1.0, 1.0, (end,)))  # fmt: skip
    model = ChatModel(tokenizer, TEMPLATE, TOOL_PARSERS["hermes"])
    runner = AgentEpisodeRunner(engine, f"{EXAMPLE / 'agent.py'}:run", model, limits, reward=math_verify_reward,
                                timeout_s=30.0)  # fmt: skip
    item = PromptItem(0, QUESTION, (), {"answer": "12"})
    try:
        sample = asyncio.run(runner.run(item, 0, 0))
    finally:
        runner.close()
    assert runner.counts["tool_calls"] == 1 and runner.counts["malformed_tool_calls"] == 0
    assert runner.counts["mismatches"] == 0 and sample.meta["calls"] == 2
    # the agent got tool_calls and answered with a tool message carrying its tool's result
    call = {
        "id": "call_0_0_0",
        "type": "function",
        "function": {"name": "calculate", "arguments": {"expression": "3*4"}},
    }
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_0_0_0", "content": "12"}]  # fmt: skip
    first, second = (tuple(encode(_render(tokenizer, history[:n]))) for n in (1, 3))
    assert [r.prompt_ids for r in engine.requests] == [first, second]
    # the trajectory: the first prompt, each turn exactly as sampled, the template's tokens between
    turn1, turn2 = (c.token_ids for c in engine.completions)
    between = second[len(first) + len(turn1) :]
    tool_turn = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(between) == tool_turn  # the template's tokens, with the tool's result
    assert sample.prompt_ids == first and sample.response_ids == turn1 + between + turn2
    assert sample.loss_mask == (1,) * len(turn1) + (0,) * len(between) + (1,) * len(turn2)
    logprobs = engine.completions[0].logprobs + (0.0,) * len(between) + engine.completions[1].logprobs
    assert sample.behav_logprobs == logprobs and set(sample.token_versions) == {engine.version}
    whole = _render(tokenizer, [*history, {"role": "assistant", "content": ANSWER}], generation=False)
    assert tokenizer.decode(first + sample.response_ids) == whole.removesuffix("\n")  # the chat, token-exact
    assert sample.reward == 1.0  # the agent returned None: math_verify scored its last reply


def test_make_model_copies_the_base_with_the_template_and_a_longer_context(tokenizer, tmp_path):
    make_model = load("make_model")
    spec = make_model.ModelSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
    base = tmp_path / "base"
    make_model.build_model(tokenizer, spec, seed=0).save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = example("make_model").build(base, tmp_path / "out", context=1024)
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).chat_template == TEMPLATE
    assert AutoConfig.from_pretrained(out, local_files_only=True).max_position_embeddings == 1024
    with pytest.raises(FileNotFoundError, match="--base"):
        example("make_model").build(tmp_path / "missing", tmp_path / "out2")


def test_the_agents_calculator_tool():
    assert AGENT.calculate("(3+4)*2") == "14" and AGENT.calculate("7/2") == "3.5"
    assert AGENT.calculate("__import__('os')").startswith("error") and AGENT.calculate("1/0").startswith("error")
    assert AGENT.call_tool("calculate", "{bad") == "error: arguments are not JSON"
    assert AGENT.call_tool("search", "{}").startswith("error: no tool")
