"""``code_debug``: fix a buggy Python function with terminal and file tools in a sandbox.

HumanEvalPack-style (HumanEvalFix): the rollout's sandbox holds ``solution.py`` (the
function, its docstring and a bug) and ``test_solution.py`` (the examples, visible). The
agent has ``bash``, ``read_file``, ``write_file`` and ``run_tests``; it ends the episode by
answering without a tool call.

Turn-level rewards (one per assistant turn; the last is the outcome):

* a turn before the last earns ``inspect_reward`` (0.2) if it looked at the code (a
  successful ``read_file``, or a ``cat``/``head``/``sed -n``/``grep``/``nl`` of a file in
  ``bash``), ``test_reward`` (0.3) if it ran the tests (``run_tests``, or ``bash``
  running test_solution.py or pytest), ``edit_reward`` (0.5) if it wrote ``solution.py``
  (``write_file``) with code that compiles;
* the last turn (outcome): 1.0 if the hidden tests pass, else 0.0.

Grading never trusts the agent's sandbox, and never shares an address space with the
solution (:mod:`environments.framework.call_bridge`): ``solution.py`` as the agent left it
goes into a fresh sandbox with a grader that holds the hidden tests (the full HumanEvalPack
``test``, more than the visible examples), the pristine ``prompt`` (its helpers) and a
nonce. The grader makes itself undumpable and forks the solution's process, which forgets
those secrets before it imports ``solution.py`` and serves calls to the entry point; the
tests call it through a proxy that sends arguments as plain data (JSON) and decodes the
reply into builtin types. The grader compares the values itself and prints ``PASS nonce``
on its own stdout; a pass needs exit code 0 and that last line. So printing a pass line,
exiting early, patching builtins, reading frames, the garbage collector, /proc or files
earns nothing (tested: ``tests/test_graders_adversarial.py``). What the hidden tests pass
to the entry point, and what it returns, must be plain data (numbers, strings, lists,
tuples, dicts, sets, bytes): a test that passes a function or checks an argument's
mutation fails.

Data: ``dataset: bigcode/humanevalpack`` (the default; its ``python`` config, loaded with
``datasets.load_dataset``) or ``dataset: sample``, 8 buggy functions with tests written
for this project, for tests and offline runs.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

from pydantic import Field

from environments.framework.base import BaseEnv, TurnLevelRewardMixin
from environments.framework.call_bridge import GRADER_PRELUDE
from environments.framework.item_order import EpochOrder
from environments.framework.sandbox_tools import (
    SandboxEnvConfig,
    SandboxEnvMixin,
    SandboxSession,
)
from environments.framework.tools import Tool, tool
from environments.rollout import Rollout
from environments.sandbox import Sandbox, SandboxError
from environments.sandbox.base import workspace_relative

SAMPLE_PATH = Path(__file__).parent / "data" / "code_debug_sample.jsonl"
SOLUTION = "solution.py"
VISIBLE_TESTS = "test_solution.py"
SYSTEM_PROMPT = (
    "You fix bugs in Python code. The working directory holds solution.py (a function with "
    "a bug) and test_solution.py (tests). Use the tools to read the code, run the tests and "
    "write the fixed solution.py. When the tests pass, reply with a one-line summary of the "
    "fix and no tool call."
)
PASS_MARK = "PASS"
GRADER = GRADER_PRELUDE + r'''

def main():
    secrets = read_secrets("spec.json")
    pid, proxy = start_solution(secrets, "solution", sys.argv[1:2])
    spec = loads(bytes(secrets).decode())
    namespace = {"__name__": "__hidden_tests__"}
    exec(compile(spec["prompt"], "prompt.py", "exec"), namespace)
    namespace[spec["entry_point"]] = proxy(spec["entry_point"])
    exec(compile(spec["test"], "hidden_tests.py", "exec"), namespace)
    os.kill(pid, 9)
    os.write(1, ("\n%s %s\n" % (PASS_MARK, spec["nonce"])).encode())


PASS_MARK = "PASS"
main()
'''
_INSPECT = re.compile(r"\b(cat|head|tail|less|more|nl|grep|sed\s+-n)\b")
_RUN_TESTS = re.compile(r"test_solution\.py|pytest|unittest")


def _is_solution(path: Any) -> bool:
    try:
        return workspace_relative(str(path)) == SOLUTION
    except ValueError:
        return False


def task_from_humanevalpack(row: dict[str, Any]) -> dict[str, Any]:
    """An item from a ``bigcode/humanevalpack`` (python) row."""
    setup = (row.get("import") or "") + (row.get("test_setup") or "")
    return {"id": row["task_id"], "entry_point": row["entry_point"], "prompt": row["prompt"],
            "buggy_solution": row["buggy_solution"],
            "canonical_solution": row["canonical_solution"],
            "example_test": setup + row["example_test"], "test": setup + row["test"]}


def load_sample() -> list[dict[str, Any]]:
    with open(SAMPLE_PATH) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_humanevalpack(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    try:
        from datasets import load_dataset
    except ImportError:
        raise RuntimeError("code_debug with a hub dataset needs `pip install datasets` "
                           "(or use dataset: sample)") from None
    return [task_from_humanevalpack(row) for row in load_dataset(name, config, split=split)]


def visible_tests(item: dict[str, Any]) -> str:
    return (f"from solution import *  # noqa: F403\n\n{item['example_test']}\n"
            "print('visible tests passed')\n")


class CodeDebugConfig(SandboxEnvConfig):
    max_turns: int = Field(default=8, ge=1)
    max_token_length: int = Field(default=8192, ge=8)
    dataset: str = "bigcode/humanevalpack"
    """``bigcode/humanevalpack`` (python config) or ``sample``: 8 buggy functions that
    ship with Lachesis."""
    dataset_config: str | None = "python"
    split: str = "test"
    shuffle: bool = True
    inspect_reward: float = 0.2
    test_reward: float = 0.3
    edit_reward: float = 0.5
    grading_timeout_s: float = Field(default=20.0, gt=0)


class CodeDebugEnv(SandboxEnvMixin, TurnLevelRewardMixin, BaseEnv):
    name = "code_debug"
    config_class = CodeDebugConfig

    def __init__(self, config: CodeDebugConfig | None = None):
        super().__init__(config)
        self.tasks: list[dict[str, Any]] | None = None
        self.order = EpochOrder(self.rng, self.config.shuffle)

    async def setup(self) -> None:
        if self.tasks is None:
            c = self.config
            self.tasks = (load_sample() if c.dataset == "sample"
                          else load_humanevalpack(c.dataset, c.dataset_config, c.split))

    async def get_next_item(self) -> dict[str, Any]:
        if self.tasks is None:
            await self.setup()
        return self.order.next(self.tasks)

    async def eval_items(self) -> list[dict[str, Any]]:
        await self.setup()
        return self.tasks[:self.config.eval_items]

    def prompt_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"`{item['entry_point']}` in solution.py fails "
                                            "its tests. Find the bug and fix it."}]

    async def prepare_sandbox(self, item: dict[str, Any], sandbox: Sandbox) -> None:
        await sandbox.write_file(SOLUTION, item["prompt"] + item["buggy_solution"])
        await sandbox.write_file(VISIBLE_TESTS, visible_tests(item))

    async def finish_sandbox(self, item: dict[str, Any], sandbox: Sandbox,
                             rollout: Rollout) -> None:
        try:
            rollout.extra["solution"] = (await sandbox.read_file(SOLUTION)).decode(
                "utf-8", errors="replace")
        except (FileNotFoundError, ValueError):  # deleted, or made a symlink/directory
            rollout.extra["solution"] = None

    def sandbox_tools(self, item: dict[str, Any], session: SandboxSession) -> list[Tool]:
        timeout = self.config.sandbox_timeout_s + 60

        async def bash(command: str) -> str:
            """Run a shell command in the working directory and return its output.

            Args:
                command: the command line, e.g. "cat solution.py".
            """
            return session.describe(await session.exec(command))

        async def read_file(path: str) -> str:
            """Return the content of a file of the working directory.

            Args:
                path: the file's path, e.g. "solution.py".
            """
            return await session.read_file(path, max_bytes=256 * 1024)

        async def write_file(path: str, content: str) -> str:
            """Replace the content of a file of the working directory (or create it).

            Args:
                path: the file's path, e.g. "solution.py".
                content: the complete new content.
            """
            await session.write_file(path, content)
            note = ""
            if path.endswith(".py"):
                try:
                    compile(content, path, "exec")
                except SyntaxError as error:
                    note = f" (warning: SyntaxError line {error.lineno}: {error.msg})"
            return f"wrote {len(content.encode())} bytes to {path}{note}"

        async def run_tests() -> str:
            """Run the tests in test_solution.py and return their output."""
            return session.describe(await session.exec(["python3", VISIBLE_TESTS]))

        return [tool(f, timeout_s=timeout) for f in (bash, read_file, write_file, run_tests)]

    def oracle_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A demonstration: read, run the tests, write the fix, run the tests, answer."""
        def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
            text = json.dumps({"name": name, "arguments": arguments})
            return {"role": "assistant", "content": f"<tool_call>\n{text}\n</tool_call>"}

        def result(name: str, content: str) -> dict[str, Any]:
            return {"role": "tool", "name": name, "tool_call_id": "call_0", "content": content}

        fixed = item["prompt"] + item["canonical_solution"]
        return [*self.prompt_messages(item),
                call("read_file", {"path": SOLUTION}),
                result("read_file", item["prompt"] + item["buggy_solution"]),
                call("write_file", {"path": SOLUTION, "content": fixed}),
                result("write_file", f"wrote {len(fixed.encode())} bytes to {SOLUTION}"),
                call("run_tests", {}),
                result("run_tests", "visible tests passed"),
                {"role": "assistant", "content": f"Fixed the bug in {item['entry_point']}."}]

    # -- rewards -----------------------------------------------------------------------------
    async def grade(self, item: dict[str, Any], solution: str | None) -> bool:
        """Run the hidden tests in a fresh sandbox against ``solution``, served from a
        process of its own (see the module docstring)."""
        if solution is None:
            return False
        nonce = secrets.token_hex(16)
        spec = {**{key: item[key] for key in ("prompt", "test", "entry_point")}, "nonce": nonce}
        async with await self.new_sandbox() as box:
            try:
                await box.write_file(SOLUTION, solution)
                await box.write_file("grader.py", GRADER)
                await box.write_file("spec.json", json.dumps(spec))
                result = await box.exec(["python3", "-I", "-S", "grader.py", item["entry_point"]],
                                        timeout_s=self.config.grading_timeout_s)
            except SandboxError:
                self.sandbox_stats.sandbox_failures += 1
                raise
        self.sandbox_stats.grading_timeouts += result.timed_out
        lines = result.stdout.strip().splitlines()
        return result.exit_code == 0 and bool(lines) and lines[-1] == f"{PASS_MARK} {nonce}"

    def turn_score(self, turn) -> float:
        c = self.config
        inspected = tested = edited = False
        for call, content in zip(turn.tool_calls, turn.tool_results):
            if content.startswith("Error:"):
                continue
            args = call.arguments
            command = str(args.get("command", ""))
            if call.name == "read_file" or (call.name == "bash" and _INSPECT.search(command)):
                inspected = True
            if call.name == "run_tests" or (call.name == "bash" and _RUN_TESTS.search(command)):
                tested = True
            if (call.name == "write_file" and _is_solution(args.get("path"))
                    and "SyntaxError" not in content):
                edited = True
        return c.inspect_reward * inspected + c.test_reward * tested + c.edit_reward * edited

    async def compute_turn_rewards(self, item: dict[str, Any],
                                   rollout: Rollout) -> list[float]:
        # A SandboxError here drops the group (counted): a grading that failed is not a 0.
        passed = await self.grade(item, rollout.extra.get("solution"))
        rewards = [self.turn_score(turn) for turn in rollout.turns[:-1]]
        return rewards + [1.0 if passed else 0.0]
