"""The agent demo's task (two-digit products with a calculator: examples/agent_demo.yaml) written as a
plain OpenAI-SDK program. Nothing in it knows about training: relayrl hands it an
``openai.AsyncOpenAI`` pointed at the episode's session of its endpoint, records every token the
model samples, and trains on the reward this returns (None: ``reward.fn`` scores the final answer).

    relayrl train examples/openai_agent.yaml

The calculator is an OpenAI function tool; the program runs the calls the model makes and sends the
results back, as any tool-using agent written against the OpenAI API does.
"""

from __future__ import annotations

import json

from relayrl.demo.agent_task import calculator  # the same tool the ToolEnv demo gives the model

MODEL = "policy"  # the endpoint's model id (serve.model_name; GET /v1/models lists it)
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return the result.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'An arithmetic expression, e.g. "47*86".'}},
            "required": ["expression"],
        },
    },
}]


def call_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        return calculator(**json.loads(arguments))
    except Exception as e:  # noqa: BLE001 - the model reads what went wrong
        return f"error: {type(e).__name__}: {e}"


async def run(client, prompt, max_turns: int = 3) -> float | None:
    messages = list(prompt.messages)
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=48)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None  # the final answer: reward.fn (math) checks its \boxed{} against the product
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": call_tool(call.function.name, call.function.arguments)})
    return 0.0  # still calling tools at the turn limit: no answer (as the ToolEnv demo scores it)
