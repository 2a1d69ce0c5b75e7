"""The built-in tiny tokenizer's chat template renders the calculator's (and the game's) turns
exactly as the task's own chat pieces do, token for token, so an OpenAI-style agent of the
calculator sees the stream its warm start was trained on."""

from __future__ import annotations

import random

from sluice.rollout.envs import TINY_CHAT, TINY_CHAT_TEMPLATE
from sluice.rollout.trajectory import text_encoder
from sluice.tasks import TASKS
from sluice.tasks.tiny_model import build_char_tokenizer


def _call(expression: str) -> dict:
    return {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def _turn_ids(tok, first: str, turns: list[tuple[str, str | None]]) -> list[int]:
    """Today's episode tokens: the first prompt (with BOS), each model turn + EOS, each observation."""
    encode = text_encoder(tok)
    ids = list(tok.encode(TINY_CHAT.first_prompt(first)))
    for action, observation in turns:
        ids += [*encode(action), tok.eos_token_id]
        if observation is not None:
            ids += encode(TINY_CHAT.env_turn(observation))
    return ids


def _template_ids(tok, messages: list[dict], generate: bool) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=generate, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def test_calculator_episode_renders_like_its_chat_pieces():
    tok = build_char_tokenizer(TASKS["calculator"].alphabet, chat_template=TINY_CHAT_TEMPLATE)
    rng = random.Random(0)
    for _ in range(20):
        row = TASKS["calculator"].make_row(rng)
        a, b = row["a"], row["b"]
        question, product = f"{a}*{b}", str(a * b)
        messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": question}]
        # the first prompt, ready for the model's first turn
        assert _template_ids(tok, messages, True) == list(tok.encode(TINY_CHAT.first_prompt(question)))
        messages.append({"role": "assistant", "content": None, "tool_calls": [_call(question)]})
        messages.append({"role": "tool", "tool_call_id": "c0", "content": product})
        expected = _turn_ids(tok, question, [(f"c{question}", product)])
        assert _template_ids(tok, messages, True) == expected
        messages.append({"role": "assistant", "content": f"a{product}"})
        episode = [(f"c{question}", product), (f"a{product}", None)]
        assert _template_ids(tok, messages, False) == _turn_ids(tok, question, episode)
        # and the text round-trips through the whole-conversation reference of the chat pieces
        assert tok.apply_chat_template(messages, tokenize=False) == tok.bos_token + TINY_CHAT.render(question, episode)


def test_game_hints_render_as_user_turns():
    tok = build_char_tokenizer(TASKS["guess_number"].alphabet, chat_template=TINY_CHAT_TEMPLATE)
    turns = [("g14", "h"), ("g18", "l"), ("g16", None)]
    messages = [{"role": "user", "content": "7-21"}]
    for action, hint in turns:
        messages.append({"role": "assistant", "content": action})
        if hint is not None:
            messages.append({"role": "user", "content": hint})
    assert _template_ids(tok, messages, False) == _turn_ids(tok, "7-21", turns)


def test_template_is_only_set_when_asked():
    assert not build_char_tokenizer("0123").chat_template
