"""A custom black-box agent: a calculator agent written with the official ``openai`` client.

Nothing in it knows about Lachesis or training. It is an ordinary OpenAI chat loop with one
tool, run as its own program; ``env.py`` next to it runs it once per rollout inside a
sandbox, where ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` point at the interception proxy
and ``LACHESIS_TASK`` holds the question. Run it by hand against any OpenAI-compatible
server the same way:

    OPENAI_BASE_URL=http://127.0.0.1:9000/v1 OPENAI_API_KEY=none OPENAI_MODEL=tiny \
        LACHESIS_TASK="What is 12 + 30?" python3 agent.py

It calls the model until the model answers without a tool call, runs every ``calculator``
call itself (in the sandbox), and writes the final answer to ``answer.txt`` in the
current directory, where the env's grading reads it. Exit status: 0 when it stopped by
itself (answered, or gave up after ``AGENT_MAX_STEPS``), 3 when the endpoint refused a
request (a rollout limit such as ``max_turns`` was reached).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

import openai

SYSTEM = ("Answer the arithmetic question. Use the calculator tool for the computation, "
          "then reply with 'The answer is N.' and no tool call.")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and "
                                         "parentheses on numbers).",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "e.g. '12 * (3 + 4)'"}},
        "required": ["expression"]}}}]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(node: ast.AST) -> float:
    """An arithmetic expression tree's value (numbers and + - * / only)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    raise ValueError(f"not allowed in an expression: {ast.dump(node)[:60]}")


def calculator(arguments: str) -> str:
    """The tool: the result of ``{"expression": ...}``, or an error the model can read."""
    try:
        expression = json.loads(arguments or "{}")["expression"]
        value = evaluate(ast.parse(str(expression), mode="eval").body)
    except (KeyError, TypeError, ValueError, SyntaxError, ZeroDivisionError) as error:
        return f"error: {type(error).__name__}: {error}"
    return str(int(value)) if float(value).is_integer() else str(value)


def main() -> int:
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL, OPENAI_API_KEY from the env
    model = os.environ.get("OPENAI_MODEL") or client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": os.environ["LACHESIS_TASK"]}]
    for _ in range(int(os.environ.get("AGENT_MAX_STEPS", "50"))):
        try:
            reply = client.chat.completions.create(model=model, messages=messages,
                                                   tools=TOOLS).choices[0].message
        except openai.BadRequestError as error:
            print(f"the endpoint refused the request: {error}", file=sys.stderr)
            return 3
        messages.append(reply.model_dump(exclude_none=True,
                                         include={"role", "content", "tool_calls"}))
        if not reply.tool_calls:
            with open("answer.txt", "w", encoding="utf-8") as f:
                f.write(reply.content or "")
            return 0
        for call in reply.tool_calls:
            result = (calculator(call.function.arguments) if call.function.name == "calculator"
                      else f"error: unknown tool {call.function.name!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print("AGENT_MAX_STEPS reached without an answer", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
