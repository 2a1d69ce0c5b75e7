"""The calculator task as an OpenAI-client agent: plain ``openai`` code, nothing from sluice.

sluice calls ``run(client, row)`` once per episode with an ``openai.AsyncOpenAI`` client whose
``base_url`` is the episode's endpoint, and the dataset row (``prompt`` is the problem, ``37*48``;
``answer`` its product). The model may call the calculator tool; the agent answers each call and
asks again, up to three model turns; the episode's reward is 1 if the final answer is
``a<product>``. The same code runs against any OpenAI-compatible server.
"""

from __future__ import annotations

import json
import re

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate a*b, a+b or a-b for integers of up to 4 digits.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 37*48"}},
                "required": ["expression"],
            },
        },
    }
]
EXPRESSION = re.compile(r"^(\d{1,4})([*+-])(\d{1,4})$")


def calculator(expression: str) -> str:
    """The tool: the value of ``a*b``, ``a+b`` or ``a-b``, else ``err``."""
    match = EXPRESSION.match(expression)
    if match is None:
        return "err"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


async def run(client, row) -> float:
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:  # a final answer
            return float(message.content == "a" + row["answer"])
        for call in message.tool_calls:
            result = calculator(json.loads(call.function.arguments).get("expression", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
