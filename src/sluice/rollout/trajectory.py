"""Token-in / token-out multi-turn trajectories: one growing token sequence per episode.

The chat format is applied once per piece of text the environment contributes (the first
prompt, then each observation), and those pieces are tokenised once, on their own, and
appended; the model's sampled tokens are appended exactly as the engine returned them, never
decoded and re-tokenised. So the sequence the trainer scores is the sequence the engine
sampled from, token for token, with:

- ``loss_mask`` 1 on sampled tokens, 0 on environment tokens (observations, turn closers);
- ``behav_logprobs`` the engine's log-probs on sampled tokens, 0.0 on environment tokens;
- ``token_versions`` the policy version of every sampled token (an interrupted turn mixes
  versions); environment tokens carry the version of the model token just before them (the
  first turn's version before any model token), so they never make a sample look older.

``ChatFormat.render`` gives the text of a whole conversation, the round-trip reference: the
decoded trajectory equals it. Nothing here talks to an engine or an environment.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.api import Completion, Sample

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class ChatFormat:
    """How a conversation becomes text. ``{observation}`` and ``{tools}`` are the placeholders.

    The model's turn is whatever it samples; it ends with ``turn_end`` (the engine's stop token,
    e.g. ``<eos>`` or ``<|im_end|>``), which a turn cut by the length cap lacks and the trajectory
    then appends as an environment token.
    """

    first: str = "{observation}"
    """The first prompt (system + user turn + the opening of the assistant turn)."""
    observation: str = "{observation}"
    """An environment turn after a model turn (user/tool turn + the opening of the next assistant turn)."""
    tools: str = "{tools}"
    """How a tool schema is shown inside ``first`` (used only when the env has tools)."""
    turn_end: str = "<eos>"
    """The text of the token that closes a model turn."""

    def first_prompt(self, observation: str, tools: Sequence[Mapping[str, Any]] = ()) -> str:
        shown = self.tools.format(tools=_tool_lines(tools)) if tools else ""
        return self.first.format(observation=observation, tools=shown)

    def env_turn(self, observation: str) -> str:
        return self.observation.format(observation=observation, tools="")

    def render(
        self, first: str, turns: Sequence[tuple[str, str | None]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> str:
        """The whole conversation as text: ``turns`` are (model text without ``turn_end``, the
        observation after it, or None after the last turn)."""
        parts = [self.first_prompt(first, tools)]
        for action, observation in turns:
            parts.append(action + self.turn_end)
            if observation is not None:
                parts.append(self.env_turn(observation))
        return "".join(parts)


def _tool_lines(tools: Sequence[Mapping[str, Any]]) -> str:
    return ";".join(f"{t['name']}({', '.join(t.get('parameters', {}))})" for t in tools)


@dataclass
class Trajectory:
    """The tokens of one episode so far (a builder; ``to_sample`` freezes it)."""

    prompt_ids: tuple[int, ...]
    start_version: int
    response_ids: list[int] = field(default_factory=list)
    behav_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    actions: list[str] = field(default_factory=list)

    @property
    def context(self) -> tuple[int, ...]:
        """What the next model turn is conditioned on."""
        return self.prompt_ids + tuple(self.response_ids)

    @property
    def last_version(self) -> int:
        return self.token_versions[-1] if self.token_versions else self.start_version

    def add_model_turn(self, completion: Completion, turn_end_ids: Sequence[int], action: str) -> None:
        """Append the sampled tokens exactly; close the turn with ``turn_end_ids`` (mask 0) if the
        engine did not sample a stop token (length cap)."""
        if not len(completion.token_ids) == len(completion.logprobs) == len(completion.versions):
            raise ValueError(f"completion {completion.request_id!r}: tokens, log-probs and versions differ in length")
        self.response_ids += completion.token_ids
        self.behav_logprobs += completion.logprobs
        self.token_versions += completion.versions
        self.loss_mask += [1] * len(completion.token_ids)
        if completion.finish_reason != "stop":
            self.add_env_tokens(turn_end_ids)
        self.turns += 1
        self.actions.append(action)

    def add_env_tokens(self, ids: Sequence[int]) -> None:
        """Append environment tokens: loss mask 0, log-prob 0.0, the last model token's version."""
        version = self.last_version
        self.response_ids += ids
        self.behav_logprobs += [0.0] * len(ids)
        self.token_versions += [version] * len(ids)
        self.loss_mask += [0] * len(ids)

    def to_sample(self, uid: str, group_id: int, reward: float, meta: dict[str, Any]) -> Sample:
        return Sample(
            uid=uid,
            group_id=group_id,
            prompt_ids=self.prompt_ids,
            response_ids=tuple(self.response_ids),
            behav_logprobs=tuple(self.behav_logprobs),
            token_versions=tuple(self.token_versions),
            loss_mask=tuple(self.loss_mask),
            reward=reward,
            meta={**meta, "turns": self.turns},
        )


ENCODED_TEXTS = 4096
"""Distinct texts an encoder remembers: the episodes of a group open with one prompt, and
observations repeat; a hit skips the tokenizer's per-call Python (≈ 60 µs here)."""


def text_encoder(tokenizer: Any, special_tokens: bool = False) -> Encode:
    """Tokenise a piece of text on its own, with or without the tokenizer's special tokens (an HF
    tokenizer, or any object with the same ``encode`` signature); the last ``ENCODED_TEXTS``
    distinct texts are remembered (tokenising is a pure function of the text)."""

    @functools.lru_cache(maxsize=ENCODED_TEXTS)
    def cached(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=special_tokens))

    def encode(text: str) -> list[int]:
        return list(cached(text))

    return encode
