"""Tool calls in the model's own format ↔ OpenAI ``tool_calls``: pluggable parsers by name.

A model writes a tool call as text in whatever format it was trained on; an OpenAI-style agent
expects ``message.tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments"}}``,
``arguments`` a JSON string). ``TOOL_PARSERS`` (a plain dict, ``agentic.tool_parser``) holds:

- ``hermes``: Hermes / Qwen-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (any number, anywhere in the turn); the text outside them is the message content;
- ``calculator``: the built-in tiny model's calculator format, a whole turn ``c<expression>``
  → a call of the (first) offered tool with ``{"expression": ...}`` (as the calculator env reads it);
- ``none``: every turn is plain text.

A call that does not parse (bad JSON, no name, an unclosed block) stays in the content as text
and is counted (``malformed``), never dropped or guessed at. The reverse direction, a message's
calls back into the model's text, is the chat template's job; ``template_messages`` only turns
each call's JSON ``arguments`` into a mapping, the form chat templates index. Nothing here talks
to an engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn as an OpenAI assistant message: ``content`` (``None`` when the turn is only
    calls), ``tool_calls`` and how many call-shaped pieces did not parse (left in ``content``)."""

    content: str | None
    tool_calls: tuple[dict[str, Any], ...] = ()
    malformed: int = 0


ToolParser = Callable[[str, Sequence[Mapping[str, Any]], str], ParsedTurn]
"""``parser(text, offered_tools, id_prefix)`` → the parsed turn; call ids are ``{id_prefix}_{k}``."""


def tool_call(call_id: str, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry (``arguments`` serialised as JSON, as the API sends it)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(dict(arguments))}}


def parse_hermes(text: str, tools: Sequence[Mapping[str, Any]], id_prefix: str = "call") -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks → calls; the rest of the text is the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    malformed = 0
    cursor = 0
    for match in _BLOCK.finditer(text):
        kept.append(text[cursor : match.start()])
        cursor = match.end()
        parsed = _call_json(match[1])
        if parsed is None:
            malformed += 1
            kept.append(match[0])
            continue
        calls.append(tool_call(f"{id_prefix}_{len(calls)}", *parsed))
    rest = text[cursor:]
    if _OPEN in rest:  # an opened block the turn never closed (cut by the length cap, or garbled)
        malformed += 1
    kept.append(rest)
    content = "".join(kept).strip()
    return ParsedTurn(content if content or not calls else None, tuple(calls), malformed)


def _call_json(body: str) -> tuple[str, Mapping[str, Any]] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments


def parse_calculator(text: str, tools: Sequence[Mapping[str, Any]], id_prefix: str = "call") -> ParsedTurn:
    """A turn ``c<expression>`` calls the first offered tool with ``{"expression": expression}``
    (whatever follows ``c``, even nothing: the tool judges it, as the calculator env does, so this
    format has no malformed calls); any other turn (or no tool offered) is content."""
    if not text.startswith("c") or not tools:
        return ParsedTurn(text)
    expression = text[1:]
    return ParsedTurn(None, (tool_call(f"{id_prefix}_0", _tool_name(tools[0]), {"expression": expression}),))


def parse_none(text: str, tools: Sequence[Mapping[str, Any]], id_prefix: str = "call") -> ParsedTurn:
    return ParsedTurn(text)


def _tool_name(tool: Mapping[str, Any]) -> str:
    """An OpenAI tool (``{"type": "function", "function": {"name": ...}}``) or a bare ``{"name"}``."""
    function = tool.get("function", tool)
    return str(function["name"])


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "calculator": parse_calculator, "none": parse_none}


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of OpenAI messages whose calls' ``arguments`` are mappings (chat templates index
    them); a call whose ``arguments`` are not a JSON object raises ``ValueError`` naming it."""
    out: list[dict[str, Any]] = []
    for k, message in enumerate(messages):
        copy = dict(message)
        if copy.get("tool_calls"):
            copy["tool_calls"] = [_template_call(call, k) for call in copy["tool_calls"]]
        out.append(copy)
    return out


def _template_call(call: Mapping[str, Any], index: int) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"messages[{index + 1}]: tool call arguments are not JSON: {arguments!r:.80}") from err
    if not isinstance(arguments, dict):
        raise ValueError(f"messages[{index + 1}]: tool call arguments must be a JSON object, got {arguments!r:.80}")
    function["arguments"] = arguments
    return {**call, "function": function}
