"""``answer_file``: the smallest real task for an agent harness: write a number to a file.

Each item asks the agent (any black-box ``agent``, e.g. a catalog harness: ``agent: pi``)
to write a number to ``answer.txt`` in its working directory and then say it is done. The
harness runs its own loop in the sandbox; the file is read out of the sandbox afterwards
and graded host-side.

Rewards (one per assistant turn; the last is the outcome): a turn before the last earns
``tool_reward`` if it made a tool call; the last turn earns 1.0 if ``answer.txt`` holds the
item's number, else 0.0.

``script: true`` forces each rollout through a two-turn episode instead of sampling it
(``scripted_turns``): a call of the harness's own shell tool writing the number, then an
answer (for a harness that ends only on a command, mini-swe-agent's submit, a call of it; both
from the catalog's ``shell_tool`` and ``submit_command``). vLLM still
records the policy's logprobs of those tokens (:mod:`environments.inference.forced_tokens`),
so a random tiny model drives a real harness end to end (the harness runs the call in the
sandbox) and the groups pass the trainer's alignment check: a smoke test of the whole path
(benchmarks/harness_table.py), not a learning task.
"""

from __future__ import annotations

import json
import random
from typing import Any

from pydantic import Field

from environments.blackbox.env import BlackBoxEnvConfig, BlackBoxEnvMixin
from environments.blackbox.harnesses import HARNESSES
from environments.framework.base import BaseEnv, TurnLevelRewardMixin
from environments.rollout import Rollout


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def script_for(agent: str, number: int) -> list[str]:
    """The scripted episode of ``agent``: its shell tool writing ``number``, then the
    answer."""
    if agent not in HARNESSES:
        raise ValueError(f"script: no scripted episode for agent {agent!r} (one of "
                         f"{', '.join(HARNESSES)}); set scripted_turns yourself")
    harness = HARNESSES[agent]
    if harness.text_edit:  # no tools: one reply that writes the file in its edit format
        return [harness.text_edit.format(path="answer.txt", content=number)]
    tool, argument = harness.shell_tool
    call = hermes_call(tool, {argument: f"echo {number} > answer.txt"})
    final = hermes_call(tool, {argument: harness.submit_command}) if harness.submit_command \
        else f"Done: answer.txt holds {number}."
    return [call, final]


class AnswerFileConfig(BlackBoxEnvConfig):
    """Settings of ``answer_file``."""

    number: int | None = None
    """The number every item asks for; None: a random one per item (from ``seed``)."""
    script: bool = False
    """Force the scripted two-turn episode (see the module docstring); needs a catalog
    ``agent``."""
    tool_reward: float = Field(default=0.1, ge=0)
    max_turns: int = Field(default=6, ge=1)
    keep_equal_score_groups: bool = True
    """Kept by default: a scripted group's rollouts score alike."""


class AnswerFileEnv(BlackBoxEnvMixin, TurnLevelRewardMixin, BaseEnv):
    name = "answer_file"
    config_class = AnswerFileConfig
    config: AnswerFileConfig

    def __init__(self, config: AnswerFileConfig | None = None):
        super().__init__(config)
        self._rng = random.Random(f"answer_file-{self.config.seed}")
        self._count = 0
        if self.config.script:
            number = self.config.number if self.config.number is not None else 42
            self.config.scripted_turns = script_for(self.config.agent, number)
            self.config.number = number

    async def get_next_item(self) -> dict[str, Any]:
        self._count += 1
        number = self.config.number if self.config.number is not None \
            else self._rng.randint(10, 99)
        return {"id": f"{self._count}-{number}", "number": number}

    def agent_task(self, item: dict[str, Any]) -> str:
        return (f"Write the number {item['number']} to the file answer.txt in the current "
                "directory (use your shell tool), then reply that you are done.")

    async def prepare_sandbox(self, item: dict[str, Any], sandbox: Any) -> None:
        pass

    async def finish_sandbox(self, item: dict[str, Any], sandbox: Any, rollout: Rollout) -> None:
        try:
            rollout.extra["answer_file"] = (await sandbox.read_file(
                "answer.txt", max_bytes=4096)).decode(errors="replace")
        except Exception:  # no file: the outcome is 0
            rollout.extra["answer_file"] = None

    def compute_turn_rewards(self, item: dict[str, Any], rollout: Rollout) -> list[float]:
        answer = rollout.extra.get("answer_file")
        solved = answer is not None and answer.strip() == str(item["number"])
        rewards = [self.config.tool_reward if turn.tool_calls else 0.0
                   for turn in rollout.turns[:-1]]
        return rewards + [1.0 if solved else 0.0]
