"""Multi-turn trajectories: sampled tokens kept exactly, env tokens masked, log-probs and versions
aligned across turns, and the token sequence round-trips through the chat format's text."""

from __future__ import annotations

import asyncio

from fakes import FakeEnv, FakeInferenceEngine
from sluice.api import PromptItem, SamplingParams
from sluice.rollout.episode import EpisodeLimits, EpisodeRunner
from sluice.rollout.trajectory import ChatFormat, text_encoder
from sluice.tasks.tiny_model import build_char_tokenizer

CHAT = ChatFormat(first="{observation}>", observation="|{observation}>", turn_end="<eos>")


class VersionBumpingEnv(FakeEnv):
    """A ``FakeEnv`` that pushes a new policy version to the engine after every step."""

    def __init__(self, engine: FakeInferenceEngine, **kwargs) -> None:
        super().__init__(**kwargs)
        self.engine = engine

    async def step(self, action: str):
        result = await super().step(action)
        self.engine.update_weights({}, self.engine.version + 1)
        return result


def _episode(turns: int = 4, turn_tokens: int = 5):
    tok = build_char_tokenizer("0123456789>|ostar")
    engine = FakeInferenceEngine(vocab=len(tok))
    env = VersionBumpingEnv(engine, turns=turns)
    runner = EpisodeRunner(
        engine,
        lambda: env,
        encode_prompt=lambda text: tok.encode(text),
        encode=text_encoder(tok),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        chat=CHAT,
        params=SamplingParams(turn_tokens, stop_token_ids=(tok.eos_token_id,)),
        limits=EpisodeLimits(max_turns=turns, max_context=200, turn_tokens=turn_tokens),
        run_seed=3,
    )
    sample = asyncio.run(runner.run(PromptItem(0, "", (), {"seed": 11}), group_id=5, k=2))
    return tok, engine, env, sample


def test_tokens_masks_logprobs_and_versions_align_across_turns():
    tok, engine, env, sample = _episode()
    n = len(sample.response_ids)
    assert len(sample.loss_mask) == len(sample.behav_logprobs) == len(sample.token_versions) == n
    assert len(engine.requests) == env.turns == sample.meta["turns"] == 4
    full = sample.prompt_ids + sample.response_ids
    assert sample.prompt_ids == tuple(tok.encode("start>"))
    cursor = 0
    sampled_turns = []
    for turn, request in enumerate(engine.requests):
        # each turn was conditioned on exactly the sequence the trainer will score, up to there
        start = len(request.prompt_ids) - len(sample.prompt_ids)
        assert request.prompt_ids == full[: len(request.prompt_ids)]
        assert all(m == 0 for m in sample.loss_mask[cursor:start])  # env tokens before the turn
        length = request.seed % request.params.max_new_tokens + 1
        sampled = [(request.seed + i) % len(tok) for i in range(length)]
        if tok.eos_token_id in sampled:
            sampled = sampled[: sampled.index(tok.eos_token_id) + 1]
        end = start + len(sampled)
        assert list(sample.response_ids[start:end]) == sampled  # kept exactly as sampled
        assert sample.loss_mask[start:end] == (1,) * len(sampled)
        assert sample.behav_logprobs[start:end] == (-0.5,) * len(sampled)
        assert sample.token_versions[start:end] == (turn,) * len(sampled)  # one version per turn here
        cursor = end
        sampled_turns.append(sampled)
    env_positions = [i for i, m in enumerate(sample.loss_mask) if m == 0]
    assert env_positions and all(sample.behav_logprobs[i] == 0.0 for i in env_positions)
    # environment tokens carry the version of the model token before them
    assert all(sample.token_versions[i] == sample.token_versions[i - 1] for i in env_positions)
    assert sample.version == 0 and sample.reward == float(bool(env.actions[0]))
    assert env.actions == [tok.decode(ids, skip_special_tokens=True) for ids in sampled_turns]


def test_trajectory_round_trips_through_the_chat_format():
    tok, engine, _env, sample = _episode(turns=3, turn_tokens=4)
    ids = list(sample.prompt_ids + sample.response_ids)
    # rebuild the conversation's text from the turns, then apply the chat format once
    turns: list[tuple[str, str | None]] = []
    for k, request in enumerate(engine.requests):
        start = len(request.prompt_ids) - len(sample.prompt_ids)
        end = start
        while end < len(sample.loss_mask) and sample.loss_mask[end] == 1:
            end += 1
        model = list(sample.response_ids[start:end])
        if model and model[-1] == tok.eos_token_id:
            model = model[:-1]
        observation = f"o{k + 1}" if k + 1 < len(engine.requests) else None
        turns.append((tok.decode(model, skip_special_tokens=False), observation))
    text = CHAT.render("start", turns)
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text
    assert tok(text)["input_ids"] == ids  # tokenising the rendered text gives the same tokens


def test_length_capped_turn_is_closed_by_an_env_token():
    tok, engine, _env, sample = _episode(turns=3, turn_tokens=3)
    closers = 0
    for request in engine.requests:
        start = len(request.prompt_ids) - len(sample.prompt_ids)
        end = start
        while end < len(sample.loss_mask) and sample.loss_mask[end] == 1:
            end += 1
        if sample.response_ids[end - 1] != tok.eos_token_id:  # cut by the cap: closer appended, mask 0
            assert sample.response_ids[end] == tok.eos_token_id and sample.loss_mask[end] == 0
            closers += 1
    assert closers > 0


def test_text_encoder_tokenises_each_distinct_text_once_and_hands_out_fresh_lists():
    """The episodes of a group open with one prompt and observations repeat: the encoder asks the
    tokenizer once per distinct text; callers still get lists of their own."""
    tok = build_char_tokenizer("0123456789>|ostar")
    calls: list[tuple[str, bool]] = []

    class Counting:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            calls.append((text, add_special_tokens))
            return tok.encode(text, add_special_tokens=add_special_tokens)

    plain, special = text_encoder(Counting()), text_encoder(Counting(), special_tokens=True)
    first = plain("12>")
    first.append(-1)  # a caller's list is its own
    assert plain("12>") == tok.encode("12>", add_special_tokens=False)
    assert special("12>") == tok.encode("12>")
    assert plain("3|") == tok.encode("3|", add_special_tokens=False)
    assert calls == [("12>", False), ("12>", True), ("3|", False)]
