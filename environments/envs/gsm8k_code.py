"""``gsm8k_code``: math word problems, with a Python interpreter in a sandbox.

The verl-tool MT-GRPO recipe: the model may run Python (the ``python`` tool; the code runs
in the rollout's own sandbox, see ``environments.sandbox``) as often as it likes within
``max_turns``, then answers ``<answer>N</answer>``.

Turn-level rewards (one per assistant turn; the last is the outcome):

* a turn before the last: 0.5 if it ran code that exited cleanly (no error, no timeout),
  plus 0.5 if the last number such a run printed is the right one (not any number of
  its output: printing every integer up to N would otherwise collect it);
* the last turn (outcome): 1.0 when the answer in ``<answer>...</answer>`` (or, failing
  that, the last ``\\boxed{...}``) equals the reference numerically (relative tolerance
  1e-6; ``3/4`` and ``1,200`` are understood; ``math-verify`` decides when it is
  installed and the numeric comparison cannot), else 0.0. A truncated episode scores 0.

Data: ``dataset: openai/gsm8k`` (the default; loaded with ``datasets.load_dataset``) or
``dataset: sample``, 20 problems written for this project (with reference code) that ship
with Lachesis, for tests and offline runs.
"""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

from pydantic import Field

from environments.framework.base import BaseEnv, TurnLevelRewardMixin
from environments.framework.item_order import EpochOrder
from environments.framework.sandbox_tools import (
    SandboxEnvConfig,
    SandboxEnvMixin,
    SandboxSession,
)
from environments.framework.tools import Tool, ToolError, tool
from environments.rollout import Rollout

SAMPLE_PATH = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
SYSTEM_PROMPT = (
    "Solve the math word problem. You can run Python code with the python tool (print what "
    "you need to see; each call is a fresh process, files in the working directory persist). "
    "When you know the result, reply with only <answer>NUMBER</answer>."
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def parse_number(text: str) -> float | None:
    """A number written as ``1,200``, ``$48.60``, ``-3``, ``3/4``, ``75%``; None otherwise."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".%")
    if not cleaned:
        return None
    try:
        return float(Fraction(cleaned))
    except (ValueError, ZeroDivisionError):
        return None


def numbers_in(text: str) -> list[float]:
    values = (parse_number(m.group()) for m in _NUMBER.finditer(text))
    return [v for v in values if v is not None]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>`` tag, else of the last ``\\boxed{}``."""
    tags = _ANSWER.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _BOXED.findall(text)
    return boxed[-1].strip() if boxed else None


def answers_match(predicted: str, reference: float | int | str) -> bool:
    """Numeric comparison; math-verify (if installed) when a side is not a plain number."""
    value = parse_number(predicted)
    target = parse_number(str(reference))
    if value is not None and target is not None:
        return close(value, target)
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    try:
        return bool(verify(parse(str(reference)), parse(predicted)))
    except Exception:  # noqa: BLE001 - unparsable either way
        return False


def parse_gsm8k_answer(solution: str) -> int | float:
    """The number after ``####`` in a GSM8K solution."""
    value = parse_number(solution.rsplit("####", 1)[-1])
    if value is None:
        raise ValueError(f"no final answer in GSM8K solution {solution[-80:]!r}")
    return int(value) if value.is_integer() else value


def load_sample() -> list[dict[str, Any]]:
    with open(SAMPLE_PATH) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_gsm8k(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """GSM8K items from the Hugging Face hub (``datasets`` is an optional dependency)."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise RuntimeError("gsm8k_code with a hub dataset needs `pip install datasets` "
                           "(or use dataset: sample)") from None
    rows = load_dataset(name, config, split=split)
    return [{"id": f"gsm8k-{split}-{i}", "question": row["question"],
             "answer": parse_gsm8k_answer(row["answer"])} for i, row in enumerate(rows)]


class GSM8KCodeConfig(SandboxEnvConfig):
    max_turns: int = Field(default=4, ge=1)
    max_token_length: int = Field(default=4096, ge=8)
    dataset: str = "openai/gsm8k"
    """``openai/gsm8k`` (or another hub dataset with question/answer columns), or
    ``sample``: the 20 problems that ship with Lachesis."""
    dataset_config: str | None = "main"
    train_split: str = "train"
    eval_split: str = "test"
    shuffle: bool = True
    """Visit the training items in a seeded random order (each epoch reshuffled)."""


class GSM8KCodeEnv(SandboxEnvMixin, TurnLevelRewardMixin, BaseEnv):
    name = "gsm8k_code"
    config_class = GSM8KCodeConfig

    def __init__(self, config: GSM8KCodeConfig | None = None):
        super().__init__(config)
        self.train: list[dict[str, Any]] | None = None
        self.order = EpochOrder(self.rng, self.config.shuffle)

    def _load(self, split: str) -> list[dict[str, Any]]:
        c = self.config
        if c.dataset == "sample":
            return load_sample()
        return load_gsm8k(c.dataset, c.dataset_config, split)

    async def setup(self) -> None:
        if self.train is None:
            self.train = self._load(self.config.train_split)

    async def get_next_item(self) -> dict[str, Any]:
        if self.train is None:
            await self.setup()
        return self.order.next(self.train)

    async def eval_items(self) -> list[dict[str, Any]]:
        items = self._load(self.config.eval_split)
        return items[:self.config.eval_items]

    def prompt_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": item["question"]}]

    def sandbox_tools(self, item: dict[str, Any], session: SandboxSession) -> list[Tool]:
        cells = 0

        async def python(code: str) -> str:
            """Run Python 3 code in a fresh process (its own sandbox) and return its output.

            Args:
                code: the program; print() what you want to see.
            """
            nonlocal cells
            cells += 1
            name = f"cell_{cells}.py"
            await session.write_file(name, code)
            result = await session.exec(["python3", name])
            if not result.ok:
                raise ToolError(session.describe(result))
            return session.describe(result)

        return [tool(python, timeout_s=self.config.sandbox_timeout_s + 60)]

    def oracle_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A correct demonstration: run the reference code, then answer."""
        code = item.get("solution_code") or f"print({item['answer']!r})"
        call = "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) \
            + "\n</tool_call>"
        return [*self.prompt_messages(item),
                {"role": "assistant", "content": call},
                {"role": "tool", "name": "python", "tool_call_id": "call_0",
                 "content": f"{item['answer']}"},
                {"role": "assistant", "content": f"<answer>{item['answer']}</answer>"}]

    def compute_turn_rewards(self, item: dict[str, Any], rollout: Rollout) -> list[float]:
        target = parse_number(str(item["answer"]))
        rewards = []
        for turn in rollout.turns[:-1]:
            ran = [r for r in turn.tool_results if not r.startswith("Error:")]
            found = target is not None and any(close(numbers_in(r)[-1], target)
                                               for r in ran if numbers_in(r))
            rewards.append(0.5 * bool(ran) + 0.5 * found)
        answered = rollout.stop == "answer"
        predicted = extract_answer(rollout.final_text) if answered else None
        rewards.append(1.0 if predicted is not None and answers_match(predicted, item["answer"])
                       else 0.0)
        return rewards
