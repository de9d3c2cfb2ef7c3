"""``arithmetic_tool``: compute an arithmetic expression with a calculator tool, then answer.

The model is asked e.g. "What is 17 * 23 - 4?". A good episode has two assistant turns:

1. a call ``<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23 - 4"}}
   </tool_call>``; the tool result comes back;
2. the answer ``<answer>387</answer>``.

Turn-level rewards, in the spirit of MT-GRPO (one per assistant turn, the last is the
outcome). Each turn earns what it did right, not its format:

* a turn before the last: 1.0 if it called ``calculator`` with the item's expression (the
  question's expression, spaces ignored) and the call executed; 0.0 otherwise: no call, a
  malformed call, a failed call, or any other expression (even one that happens to give
  the same number: the turn is rewarded for the right call, not for luck);
* the last turn (outcome): 1.0 for exactly ``<answer>N</answer>`` with the right N and
  nothing else but whitespace, 0.8 for the right N inside other text, 0.1 for a wrong
  number in the tags, 0.0 otherwise (no tags, or a truncated episode). With
  ``reported_result_score`` above 0.1, a wrong number that is exactly what the episode's
  last calculator call returned (a faithful report of a wrong call) earns that instead:
  the answer turn did its part, reporting the tool's result, and the call that was wrong
  is already scored 0 on its own turn.

Difficulty: ``n_operands`` numbers in ``[0, max_operand]`` joined by ``operators``. With
``easy_fraction`` > 0 that share of items is easy instead: ``a + b`` with both in
``[0, easy_max_operand]``, a sum small enough to learn by heart, so the outcome can be
earned without the tool. ``outcome_only`` scores the outcome alone (a float per episode,
no turn rewards: the setting of envs that only score the outcome, for GiGPO and GRPO-OR).
``oracle_direct_fraction`` makes that share of the easy items'
demonstrations answer at once, without the calculator (a warm start that sometimes skips
the tool). A direct answer is one turn: its only reward is the outcome.

``question_style: words`` asks word problems instead (:mod:`environments.envs.word_problems`:
"A box holds 23 pencils. How many pencils are in 17 boxes?"): the model reads the
expression out of the story, and a call with the story's two numbers and the right value
is the right call, in either order. ``oracle_guess_fraction`` makes that share of all
demonstrations answer at once from memory with a near miss
(:func:`~environments.envs.word_problems.mental_guess`), as a small model does when it
does not use the tool: a warm start whose tool use RL has to make habitual.
"""

from __future__ import annotations

import ast
import operator
import random
import re
import zlib
from typing import Any, Literal

from pydantic import Field

from environments.envs.word_problems import mental_guess, word_problem
from environments.framework.base import BaseEnv, EnvConfig, TurnLevelRewardMixin
from environments.framework.tools import tool
from environments.rollout import Rollout

SYSTEM_PROMPT = (
    "You solve arithmetic questions. First call the calculator tool with the expression, "
    "then reply with only the result as <answer>N</answer>."
)
WORDS_SYSTEM_PROMPT = (
    "Solve the word problem. First call the calculator tool with the arithmetic "
    "expression, then reply with only the result as <answer>N</answer>."
)
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_NUMBER = re.compile(r"\d+")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def evaluate_expression(expression: str) -> int:
    """Integer arithmetic (+ - * // % and parentheses) on non-negative integer literals."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**18:
                raise ValueError("result too large")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"unsupported syntax: {ast.unparse(node)!r} (integers and + - * // % only)")

    return value(tree.body)


def mistype(expression: str, rng: random.Random) -> str:
    """``expression`` with one digit of one operand replaced by another digit (no leading
    zero, no zero divisor): a demonstrator's slip."""
    parts = expression.split(" ")
    while True:
        i = rng.randrange(0, len(parts), 2)  # operands sit at even positions
        j = rng.randrange(len(parts[i]))
        digits = [d for d in "0123456789"
                  if d != parts[i][j] and (d != "0" or j > 0 or len(parts[i]) == 1)]
        typo = parts[i][:j] + rng.choice(digits) + parts[i][j + 1:]
        mistyped = " ".join([*parts[:i], typo, *parts[i + 1:]])
        try:
            evaluate_expression(mistyped)
        except ValueError:  # a zero divisor: mistype another digit
            continue
        return mistyped


def reported_number(text: str) -> int | None:
    """The number inside the answer tags, or None."""
    match = _ANSWER.search(text)
    return int(match.group(1)) if match else None


def last_result(rollout: Any) -> int | None:
    """The number the episode's last tool call returned (None: no call, or it returned no
    number, e.g. an error)."""
    results = [r for turn in rollout.turns for r in turn.tool_results]
    return int(results[-1]) if results and re.fullmatch(r"-?\d+", results[-1].strip()) \
        else None


@tool(inline=True)  # microseconds of pure Python: no worker thread
def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers with + - * // % and parentheses, e.g. "17 * (3 + 4)".
    """
    return str(evaluate_expression(expression))


class ArithmeticToolConfig(EnvConfig):
    max_turns: int = Field(default=3, ge=1)
    max_token_length: int = Field(default=2048, ge=8)
    n_operands: int = Field(default=2, ge=2, le=8)
    """Numbers in an expression."""
    max_operand: int = Field(default=99, ge=1)
    """Operands are drawn from [0, max_operand]."""
    operators: list[str] = Field(default_factory=lambda: ["+", "-", "*"])
    easy_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of items that are easy: ``a + b`` with ``a, b`` in ``[0, easy_max_operand]``."""
    easy_max_operand: int = Field(default=9, ge=1)
    oracle_direct_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the easy items whose demonstration answers directly, without the tool."""
    outcome_only: bool = False
    """Score only the outcome: one float per episode (the last turn's score), no turn
    rewards. For estimators that need no per-turn scores (``grpo``, ``gigpo``); the
    ``tool_success``/``right_expression`` metrics are still reported."""
    reported_result_score: float = Field(default=0.1, ge=0.0, lt=0.8)
    """The outcome's score for a wrong number that is the result of the episode's last
    calculator call (the default, 0.1, is any wrong number's: no difference). Between 0.1
    and 0.8 it tells the answer turn to report the tool's result even after a wrong call,
    a signal the outcome alone gives only when the call was right."""
    question_style: Literal["expression", "words"] = "expression"
    """``expression``: "What is 17 * 23?"; ``words``: a word problem with two numbers
    (:mod:`environments.envs.word_problems`; ``n_operands`` and ``easy_fraction`` do not
    apply, products take numbers up to ``max_operand``, sums and differences up to ten
    times it)."""
    oracle_guess_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of all demonstrations that answer at once, without the calculator, with a
    near miss (2-15 % off): a warm start that often skips the tool and is then wrong."""
    oracle_slip_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the demonstrations whose calculator call has a slip: one digit of one
    operand mistyped; the tool result and the answer then follow the mistyped expression
    (an imperfect demonstrator, which RL can improve on)."""


class ArithmeticToolEnv(TurnLevelRewardMixin, BaseEnv):
    name = "arithmetic_tool"
    config_class = ArithmeticToolConfig
    tools = [calculator]

    def __init__(self, config: ArithmeticToolConfig | None = None):
        super().__init__(config)
        bad = [op for op in self.config.operators if op not in ("+", "-", "*", "//", "%")]
        if bad:
            raise ValueError(f"operators: unsupported {bad}; use + - * // %")
        self._items_made = 0

    def make_item(self, index: int, rng) -> dict[str, Any]:
        c = self.config
        if c.question_style == "words":
            question, expression = word_problem(rng, c.max_operand, c.operators)
            return {"id": f"arith-{c.seed}-{index}", "question": question,
                    "expression": expression, "answer": evaluate_expression(expression),
                    "easy": False, "words": True}
        # No draw when there are no easy items: the item stream of older configs is unchanged.
        easy = c.easy_fraction > 0 and rng.random() < c.easy_fraction
        if easy:
            expression = f"{rng.randint(0, c.easy_max_operand)} + {rng.randint(0, c.easy_max_operand)}"
        else:
            terms = [str(rng.randint(0, c.max_operand)) for _ in range(c.n_operands)]
            expression = terms[0]
            for term in terms[1:]:
                op = rng.choice(c.operators)
                if op in ("//", "%") and term == "0":
                    term = "1"
                expression += f" {op} {term}"
        return {"id": f"arith-{c.seed}-{index}", "question": f"What is {expression}?",
                "expression": expression, "answer": evaluate_expression(expression),
                "easy": easy}

    async def get_next_item(self) -> dict[str, Any]:
        item = self.make_item(self._items_made, self.rng)
        self._items_made += 1
        return item

    async def eval_items(self) -> list[dict[str, Any]]:
        rng = random.Random(f"eval-{self.config.seed}")  # disjoint from training draws
        items = [self.make_item(i, rng) for i in range(self.config.eval_items)]
        for item in items:
            item["id"] = item["id"].replace("arith-", "arith-eval-")
        return items

    def prompt_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        system = WORDS_SYSTEM_PROMPT if item.get("words") else SYSTEM_PROMPT
        return [{"role": "system", "content": system},
                {"role": "user", "content": item["question"]}]

    def oracle_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A demonstration (for SFT warm starts), in the format the loop produces: the
        calculator call, its result and the answer, or, for the share
        ``oracle_direct_fraction`` of easy items, the answer at once; for the share
        ``oracle_guess_fraction`` of all items, a near miss at once (:func:`mental_guess`).
        For the share ``oracle_slip_fraction`` the call has a slip (:func:`mistype`) and the
        result and answer follow it. The choices hash the item id, so they are the same
        every time."""
        if item.get("easy") and (zlib.crc32(item["id"].encode()) / 2**32
                                 < self.config.oracle_direct_fraction):
            return [*self.prompt_messages(item),
                    {"role": "assistant", "content": f"<answer>{item['answer']}</answer>"}]
        guesses = random.Random(f"guess:{item['id']}")
        if guesses.random() < self.config.oracle_guess_fraction:
            guess = mental_guess(item["answer"], guesses)
            return [*self.prompt_messages(item),
                    {"role": "assistant", "content": f"<answer>{guess}</answer>"}]
        expression = item["expression"]
        slips = random.Random(f"slip:{item['id']}")
        if slips.random() < self.config.oracle_slip_fraction:
            expression = mistype(expression, slips)
        result = evaluate_expression(expression)
        call = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
                + expression + '"}}\n</tool_call>')
        return [*self.prompt_messages(item),
                {"role": "assistant", "content": call},
                {"role": "tool", "name": "calculator", "tool_call_id": "call_0",
                 "content": str(result)},
                {"role": "assistant", "content": f"<answer>{result}</answer>"}]

    @staticmethod
    def outcome_score(text: str, answer: int) -> float:
        match = _ANSWER.search(text)
        if match is None:
            return 0.0
        if int(match.group(1)) != answer:
            return 0.1
        return 1.0 if _ANSWER.fullmatch(text.strip()) else 0.8

    @staticmethod
    def right_call(item: dict[str, Any], turn: Any) -> bool:
        """The turn called the calculator with the item's expression (spaces ignored),
        and the call executed (its result is the answer). A word problem's call may
        write its two numbers in either order: it needs the story's numbers (each as
        often as the story has it, no other) and the right value."""
        if turn.tool_errors:
            return False
        want = "".join(item["expression"].split())
        for call in turn.tool_calls:
            expression = str(call.arguments.get("expression", "")) \
                if call.name == "calculator" else None
            if expression is None:
                continue
            if "".join(expression.split()) == want:
                return True
            if item.get("words") and sorted(_NUMBER.findall(expression)) == sorted(
                    _NUMBER.findall(item["expression"])):
                try:
                    if evaluate_expression(expression) == item["answer"]:
                        return True
                except ValueError:
                    continue
        return False

    def rollout_metrics(self, item: dict[str, Any], rollout: Rollout,
                        scores: float | list[float]) -> dict[str, float]:
        """``tool_success``: the episode called the calculator and every call executed;
        ``right_expression``: a turn made the right call (:meth:`right_call`);
        ``correct``: the final answer holds the right number (outcome >= 0.8);
        ``exact_match``: it is exactly ``<answer>N</answer>`` (outcome 1.0);
        ``direct_answer``: the episode answered without calling any tool."""
        calls = sum(len(t.tool_calls) for t in rollout.turns)
        outcome = scores[-1] if isinstance(scores, list) else scores
        return {
            "tool_success": float(calls > 0 and rollout.tool_errors == 0),
            "right_expression": float(any(self.right_call(item, t)
                                          for t in rollout.turns[:-1])),
            "correct": float(outcome >= 0.8),
            "exact_match": float(outcome == 1.0),
            "direct_answer": float(calls == 0 and outcome > 0.0),
        }

    def scores_each_turn(self) -> bool:
        return not self.config.outcome_only

    def compute_reward(self, item: dict[str, Any], rollout: Rollout) -> float:
        """With ``outcome_only``: the last turn's score of :meth:`compute_turn_rewards`."""
        return self.compute_turn_rewards(item, rollout)[-1]

    def compute_turn_rewards(self, item: dict[str, Any], rollout: Rollout) -> list[float]:
        rewards = [float(self.right_call(item, turn)) for turn in rollout.turns[:-1]]
        final = rollout.turns[-1]
        answered = not rollout.truncated or rollout.stop == "answer"
        outcome = self.outcome_score(final.text, item["answer"]) if answered else 0.0
        if outcome == 0.1 and reported_number(final.text) == last_result(rollout):
            outcome = self.config.reported_result_score
        rewards.append(outcome)
        return rewards
