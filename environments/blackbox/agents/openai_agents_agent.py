"""A coding agent on the OpenAI Agents SDK (``openai-agents``): the SDK's own loop, one
``bash`` tool, the task from ``LACHESIS_TASK``.

It is the ``openai-agents`` entry of the harness catalog
(:mod:`environments.blackbox.harnesses`): it runs under the Python of the harness's own
install (a venv with ``openai-agents`` in it), never with Lachesis's packages.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... OPENAI_MODEL=... LACHESIS_TASK="..." \\
        python openai_agents_agent.py

Settings (environment): ``OPENAI_AGENTS_API`` (``responses``, the SDK's default, or
``chat_completions``), ``AGENT_STREAM=1`` (streamed replies), ``AGENT_MAX_STEPS`` (the
SDK's ``max_turns``, default 30), ``AGENT_COMMAND_TIMEOUT`` (seconds per command, default
60). Tracing is off (its exporter would call api.openai.com). Exit status: 0 when the
model answered, 3 when the endpoint refused a request, 4 when ``AGENT_MAX_STEPS`` ran out.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI, BadRequestError

INSTRUCTIONS = ("You are a careful software engineer working in a repository (the current "
                "directory). Use the bash tool to inspect files, run commands and tests, and "
                "edit files. When you are done, reply with a short summary and no tool call.")
OUTPUT_CHARS = 4000


@function_tool
def bash(command: str) -> str:
    """Run a shell command in the repository; returns its exit code and output.

    Args:
        command: the command line.
    """
    timeout = float(os.environ.get("AGENT_COMMAND_TIMEOUT", "60"))
    try:
        done = subprocess.run(command, shell=True, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"error: the command ran past {timeout:g} s and was killed"
    return f"exit code {done.returncode}\n{(done.stdout + done.stderr)[-OUTPUT_CHARS:]}"


async def main() -> int:
    set_tracing_disabled(True)
    client = AsyncOpenAI(max_retries=0)
    name = os.environ.get("OPENAI_MODEL") or "policy"
    api = os.environ.get("OPENAI_AGENTS_API", "responses")
    if api == "chat_completions":
        model = OpenAIChatCompletionsModel(model=name, openai_client=client)
    elif api == "responses":
        model = OpenAIResponsesModel(model=name, openai_client=client)
    else:
        print(f"OPENAI_AGENTS_API must be responses or chat_completions, not {api!r}",
              file=sys.stderr)
        return 2
    agent = Agent(name="coder", instructions=INSTRUCTIONS, tools=[bash], model=model)
    task = os.environ["LACHESIS_TASK"]
    steps = int(os.environ.get("AGENT_MAX_STEPS", "30"))
    try:
        if os.environ.get("AGENT_STREAM") == "1":
            result = Runner.run_streamed(agent, task, max_turns=steps)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, task, max_turns=steps)
    except BadRequestError as error:
        print(f"the endpoint refused the request: {error}", file=sys.stderr)
        return 3
    except MaxTurnsExceeded:
        print("AGENT_MAX_STEPS reached", file=sys.stderr)
        return 4
    print(result.final_output or "")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
