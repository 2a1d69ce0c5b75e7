"""A word-problem agent written for the OpenAI API with tools: plain ``openai`` client code.

``solve`` is what any OpenAI tools agent looks like: it sends the question with a ``calculate``
tool, runs every ``message.tool_calls`` entry and answers with ``role: "tool"`` messages, and
stops at the first reply without calls. Nothing in it knows about sluice; it runs against any
OpenAI-compatible server. ``run(client, row)`` is the entry point sluice calls
(``agentic.agent: examples/qwen_tools_agent/agent.py:run``) once per episode, with a client whose
``base_url`` is the episode's endpoint and the dataset row (``prompt`` is the question); it returns
``None``, so the run's reward function (``math_verify``) scores the last reply's ``\\boxed{}``.
"""

from __future__ import annotations

import ast
import json
import operator

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The tool: ``+ - * /`` over numbers and parentheses; anything else is an error message."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        return f"error: {err}"
    return str(int(result)) if float(result).is_integer() else str(result)


def call_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if name != "calculate" or not isinstance(args, dict):
        return f"error: no tool {name!r}"
    return calculate(str(args.get("expression", "")))


async def solve(client, question: str, model: str = "policy", max_rounds: int = 4) -> str:
    """Ask, run the tools the model calls, ask again; the first reply without calls is the answer."""
    messages = [{"role": "user", "content": question}]
    for _ in range(max_rounds):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            result = call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


async def run(client, row) -> None:
    await solve(client, row["prompt"])
    return None  # the run's reward function scores the last reply
