"""A minimal coding agent: an OpenAI chat-completions loop with bash and file tools.

It is what any OpenAI-client agent looks like to Lachesis: it reads its endpoint from
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (the interception proxy's, in training) and its
task from ``LACHESIS_TASK``, works in the current directory, and stops when the model
answers without a tool call. Nothing in it knows about training.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... LACHESIS_TASK="fix the bug" python3 reference_agent.py

Settings (environment): ``OPENAI_MODEL`` (default: the first of ``/v1/models``),
``AGENT_MAX_STEPS`` (default 30), ``AGENT_STREAM=1`` (streamed replies),
``AGENT_COMMAND_TIMEOUT`` (seconds per bash command, default 60). Exit status: 0 when the
model answered, 3 when the endpoint refused a request (a limit reached), 4 when
``AGENT_MAX_STEPS`` ran out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai

SYSTEM = ("You are a careful software engineer working in a repository (the current "
          "directory). Use the tools to inspect files, run commands and tests, and edit "
          "files. When you are done, reply with a short summary and no tool call.")
TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command in the repository; returns its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "the command line"}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Return the content of a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path relative to the repository"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file's content (or create the file).",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path relative to the repository"},
            "content": {"type": "string", "description": "the complete new content"}},
            "required": ["path", "content"]}}},
]
OUTPUT_CHARS = 4000


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
        if name == "bash":
            timeout = float(os.environ.get("AGENT_COMMAND_TIMEOUT", "60"))
            try:
                done = subprocess.run(args["command"], shell=True, capture_output=True,
                                      text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return f"error: the command ran past {timeout:g} s and was killed"
            out = (done.stdout + done.stderr)[-OUTPUT_CHARS:]
            return f"exit code {done.returncode}\n{out}"
        if name == "read_file":
            with open(args["path"], encoding="utf-8", errors="replace") as f:
                return f.read()[:OUTPUT_CHARS * 4]
        if name == "write_file":
            with open(args["path"], "w", encoding="utf-8") as f:
                f.write(args["content"])
            return f"wrote {len(args['content'])} characters to {args['path']}"
        return f"error: unknown tool {name!r}"
    except (KeyError, ValueError, OSError) as error:
        return f"error: {type(error).__name__}: {error}"


def complete(client: openai.OpenAI, model: str, messages: list, stream: bool):
    """One model call; returns the assistant message as a dict."""
    if not stream:
        message = client.chat.completions.create(model=model, messages=messages,
                                                 tools=TOOLS).choices[0].message
        return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
    content, calls = "", {}
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            entry["id"] += call.id or ""
            if call.function:
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def main() -> int:
    client = openai.OpenAI(max_retries=0)
    model = os.environ.get("OPENAI_MODEL") or client.models.list().data[0].id
    stream = os.environ.get("AGENT_STREAM") == "1"
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": os.environ["LACHESIS_TASK"]}]
    for _ in range(int(os.environ.get("AGENT_MAX_STEPS", "30"))):
        try:
            message = complete(client, model, messages, stream)
        except openai.BadRequestError as error:
            print(f"the endpoint refused the request: {error}", file=sys.stderr)
            return 3
        messages.append(message)
        if not message.get("tool_calls"):
            print(message.get("content") or "")
            return 0
        for call in message["tool_calls"]:
            result = run_tool(call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    print("AGENT_MAX_STEPS reached", file=sys.stderr)
    return 4


if __name__ == "__main__":
    sys.exit(main())
