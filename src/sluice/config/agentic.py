"""The ``agentic`` config section: multi-turn environments, EnvRunner modes, redundancy, timeouts.

Only declares and validates; ``rollout/agentic.py`` turns it into an ``EnvRunner`` inside the
rollout worker (over environments, or a user's agent behind the OpenAI-compatible endpoint).
Defaults leave a single-turn task single-turn (``env: null``), and give the built-in multi-turn
tasks (``task.name: calculator | guess_number``) their own environment.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sluice.config.section import Section


class AgenticConfig(Section):
    env: str | None = None
    """The environment of a multi-turn run: a built-in (``calculator``, ``guess_number``) or a user
    class by import path (``my_pkg.envs:MyEnv``). ``null``: the task's own (none for single-turn
    tasks). Each episode gets a fresh instance; its ``reset`` receives the dataset row's fields."""

    env_kwargs: dict[str, Any] = Field(default={})
    """Keyword arguments of the environment class."""

    mode: Literal["async", "barrier"] = "async"
    """``async``: environment-level async rollout, every episode advances on its own (ROLL Flash
    §5.2.1). ``barrier``: the episodes of an admission wave move in lockstep, turn by turn; exists
    only to measure against."""

    max_turns: int = Field(default=8, ge=1)
    """Model turns per episode at most."""

    turn_tokens: int | None = Field(default=None, ge=1)
    """Tokens the model may sample per turn (``null``: ``rollout.max_new_tokens`` or the task's cap)."""

    max_context: int | None = Field(default=None, ge=2)
    """Prompt + all turns, in tokens; an episode that reaches it ends (``finish_reason: context``).
    ``null``: the model's ``max_position_embeddings``."""

    group_redundancy: int = Field(default=0, ge=0)
    """Extra episodes per group: a group runs ``group_size + group_redundancy`` and completes with
    its first ``group_size`` finished; the rest are aborted and counted
    (``env_episodes_aborted_straggler``). Use it against slow or hanging environments."""

    num_env_groups: int | None = Field(default=None, ge=1)
    """Env groups generating at once per step (``≥ rollout.prompts_per_step``; ``null``: equal).
    The surplus beyond ``prompts_per_step`` are redundant groups: the step takes the first groups
    to complete and aborts the rest (counted as ``discarded_redundant``). Raising it is a stronger
    defence against stragglers than ``group_redundancy`` (ROLL Flash Fig. 10)."""

    step_timeout_s: float | None = Field(default=60.0, gt=0.0)
    """Seconds an env ``step`` may take; a slower one fails its episode (``env_episodes_env_timeout``).
    ``null``: wait forever (only redundancy then gets past a hung env)."""

    reset_timeout_s: float | None = Field(default=60.0, gt=0.0)
    """Seconds an env ``reset`` may take."""

    env_latency_s: float = Field(default=0.0, ge=0.0)
    """μ: seconds each env ``step`` waits before it answers, as a tool API, a sandbox or a web
    environment would (a waiting-bound workload: ``sluice bench e2e --workload agentic-wait``),
    drawn per call from a Gaussian of mean μ and standard deviation μ, clipped at 0 (ROLL Flash's
    simulated-environment setting); the wait uses no CPU. 0: none."""

    chat_first: str = "{observation}>"
    """Chat format: the first prompt (``{observation}``, ``{tools}``). The default is the tiny
    character-level models' format; a chat model needs its template's pieces, e.g.
    ``<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n``."""

    chat_observation: str = "|{observation}>"
    """Chat format: an environment turn after a model turn (and the opening of the next one)."""

    chat_tools: str = "{tools}"
    """Chat format: how a tool env's schema appears where ``chat_first`` says ``{tools}``."""

    chat_turn_end: str | None = None
    """Chat format: the token that ends a model turn (the sampling stop token); ``null``: the
    tokenizer's EOS token."""

    agent: str | None = None
    """Your own agent instead of an ``Env``: ``package.module:run``, a function ``run(client, row)``
    given an ``openai`` client whose ``base_url`` is its episode's OpenAI-compatible endpoint and
    the dataset row; it returns the reward, or ``None`` to let the run's reward function score the
    last model turn. ``async def`` runs on the agents' own event loop, a plain ``def`` in its thread
    pool. Needs the ``openai`` package (``pip install 'sluice[agent]'``). Excludes ``env``."""

    agent_process: bool = True
    """Run the agents in a process of their own (their calls reach the rollout worker over a pipe),
    so their Python — the ``openai`` client builds and parses every call — does not hold the GIL
    the engine's decode loop needs. ``false``: on an event loop in a thread of the rollout worker,
    calls in process (no socket either way)."""

    agent_timeout_s: float | None = Field(default=300.0, gt=0.0)
    """Seconds an agent's episode may take; a slower one is cancelled and fails its episode
    (``env_episodes_agent_timeout``). ``null``: no limit."""

    hold_for_calls: float = Field(default=1.0, ge=0.0)
    """How long an engine in the rollout worker's process may wait before a decode step for agent
    calls it knows are coming (episodes answered that have not called again or ended), while they
    outnumber its batch, in multiples of its recent step time; it steps at once when they arrive.
    Fewer, fuller steps when the agents' round trips would otherwise spread turns over many small
    batches (``engine_holds``, ``engine_hold_s``). ``0``: never wait."""

    tool_parser: Literal["hermes", "calculator", "none"] = "hermes"
    """How a model turn's tool calls become OpenAI ``tool_calls`` for an agent: ``hermes``
    (``<tool_call>{json}</tool_call>``, Qwen / Hermes chat models), ``calculator`` (the built-in
    tiny model's ``c<expression>``), ``none`` (text only). Malformed calls stay text and are counted
    (``env_agent_malformed_tool_calls``)."""

    chat_template: str | None = None
    """The Jinja chat template an agent's calls are rendered with. ``null``: the tokenizer's own;
    for the built-in multi-turn tasks, whose tokenizers have none, ``TINY_CHAT_TEMPLATE``."""

    template_mismatch: Literal["refuse", "restart"] = "refuse"
    """When an agent's call renders to a prompt that does not extend the tokens recorded so far
    (the template re-renders history differently): ``refuse`` answers the call with an error and
    fails the episode; ``restart`` starts a new segment from that prompt, dropping the earlier
    turns from training. Either way it is counted (``env_agent_mismatches``)."""
