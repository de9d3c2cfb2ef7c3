"""The arithmetic_tool env's calculator, items and turn-level rewards (hand-computed)."""

from __future__ import annotations

import asyncio

import pytest

from environments.envs.arithmetic_tool import (
    ArithmeticToolConfig,
    ArithmeticToolEnv,
    calculator,
    evaluate_expression,
)
from environments.framework.tools import ToolError
from environments.inference.tool_parsers import get_parser
from environments.rollout import AssistantTurn, ParsedToolCall, Rollout


def test_calculator_computes_integers_and_refuses_anything_else():
    assert evaluate_expression("17 * (3 + 4) - 5 // 2 % 3") == 17 * 7 - 5 // 2 % 3
    assert asyncio.run(calculator.call({"expression": "-3 * 4"})) == "-12"
    for bad in ["__import__('os')", "2 ** 10", "1 / 0", "1 // 0", "x + 1", "1.5 + 2"]:
        with pytest.raises(ToolError):
            asyncio.run(calculator.call({"expression": bad}))


def test_items_follow_the_configured_difficulty_and_eval_items_differ():
    env = ArithmeticToolEnv(ArithmeticToolConfig(n_operands=4, max_operand=9,
                                                 operators=["*"], eval_items=5))
    items = [asyncio.run(env.get_next_item()) for _ in range(20)]
    for item in items:
        numbers = [int(t) for t in item["expression"].split(" * ")]
        assert len(numbers) == 4 and all(0 <= n <= 9 for n in numbers)
        assert item["answer"] == evaluate_expression(item["expression"])
    assert len({i["id"] for i in items}) == 20
    eval_ids = {i["id"] for i in asyncio.run(env.eval_items())}
    assert len(eval_ids) == 5 and not eval_ids & {i["id"] for i in items}
    with pytest.raises(ValueError, match="operators"):
        ArithmeticToolEnv(ArithmeticToolConfig(operators=["**"]))


def turn(text, calls=(), errors=(), results=()):
    return AssistantTurn((0, 1), "stop", list(calls), list(errors), None, text, list(results))


ITEM = {"id": "x", "question": "What is 6 * 7?", "expression": "6 * 7", "answer": 42}
CALL = ParsedToolCall("calculator", {"expression": "6 * 7"}, "")
SPACELESS = ParsedToolCall("calculator", {"expression": "6*7"}, "")
OTHER = ParsedToolCall("calculator", {"expression": "40 + 2"}, "")


@pytest.mark.parametrize("turns, stop, expected", [
    # the right call, then the exact answer
    ([turn("", [CALL], results=["42"]), turn("<answer>42</answer>")], "answer", [1.0, 1.0]),
    # the right call written without spaces is still the right call
    ([turn("", [SPACELESS], results=["42"]), turn("<answer>42</answer>")], "answer", [1.0, 1.0]),
    # a well-formed call with another expression earns nothing, even one that gives the
    # same number; the right number inside other text earns 0.8
    ([turn("", [OTHER], results=["42"]), turn("so <answer>42</answer>")], "answer", [0.0, 0.8]),
    # failing call, then a wrong number in the tags
    ([turn("", [CALL], ["boom"], ["Error: boom"]), turn("<answer>7</answer>")], "answer", [0.0, 0.1]),
    # no tool use at all: one turn, the outcome
    ([turn("<answer>42</answer>")], "answer", [1.0]),
    # ran out of turns while still calling tools: the outcome is 0
    ([turn("", [CALL], results=["42"]), turn("", [CALL], results=["42"])], "max_turns", [1.0, 0.0]),
])
def test_turn_rewards(turns, stop, expected):
    env = ArithmeticToolEnv()
    rollout = Rollout(messages=[], tools=None, turns=turns, stop=stop,
                           truncated=stop != "answer")
    assert env.compute_turn_rewards(ITEM, rollout) == expected


WRONG = ParsedToolCall("calculator", {"expression": "6 * 8"}, "")


@pytest.mark.parametrize("turns, expected", [
    # a wrong call, its result reported faithfully: the answer turn did its part
    ([turn("", [WRONG], results=["48"]), turn("<answer>48</answer>")], [0.0, 0.5]),
    # a wrong call, its result miscopied: any wrong number
    ([turn("", [WRONG], results=["48"]), turn("<answer>46</answer>")], [0.0, 0.1]),
    # the right call, its result miscopied
    ([turn("", [CALL], results=["42"]), turn("<answer>24</answer>")], [1.0, 0.1]),
    # the right call reported: the full outcome, as before
    ([turn("", [CALL], results=["42"]), turn("<answer>42</answer>")], [1.0, 1.0]),
    # the reported number is the LAST call's result; a failed call returned no number
    ([turn("", [WRONG, CALL], results=["48", "42"]), turn("<answer>48</answer>")], [1.0, 0.1]),
    ([turn("", [WRONG], ["boom"], ["Error: boom"]), turn("<answer>48</answer>")], [0.0, 0.1]),
])
def test_a_faithfully_reported_wrong_result_earns_the_reported_result_score(turns, expected):
    """``reported_result_score``: an answer that is the number the episode's last
    calculator call returned, when that is not the right answer, earns it instead of a
    wrong number's 0.1; ``correct`` (what the evaluations count) does not change."""
    env = ArithmeticToolEnv(ArithmeticToolConfig(reported_result_score=0.5))
    rollout = Rollout(messages=[], tools=None, turns=turns, stop="answer", truncated=False)
    scores = env.compute_turn_rewards(ITEM, rollout)
    assert scores == expected
    assert env.rollout_metrics(ITEM, rollout, scores)["correct"] == float(expected[-1] == 1.0)
    assert ArithmeticToolEnv().compute_turn_rewards(ITEM, rollout)[-1] == \
        (0.1 if expected[-1] == 0.5 else expected[-1])  # the default: no difference


def test_oracle_demonstration_parses_and_earns_full_reward():
    env = ArithmeticToolEnv()
    messages = env.oracle_messages(ITEM)
    parsed = get_parser("hermes").parse(messages[2]["content"])
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "6 * 7"})]
    rollout = Rollout(messages=messages, tools=None, stop="answer", turns=[
        turn(messages[2]["content"], parsed.calls, results=[messages[3]["content"]]),
        turn(messages[4]["content"])])
    assert env.compute_turn_rewards(ITEM, rollout) == [1.0, 1.0]


def test_easy_items_can_be_answered_without_the_tool():
    """The credit-assignment setting: a share of easy sums, and demonstrations that answer
    a share of them directly, earning the outcome alone."""
    env = ArithmeticToolEnv(ArithmeticToolConfig(seed=3, easy_fraction=0.5,
                                                 oracle_direct_fraction=0.5))
    items = [asyncio.run(env.get_next_item()) for _ in range(400)]
    easy = [i for i in items if i["easy"]]
    assert 150 < len(easy) < 250
    for item in easy:
        a, b = (int(t) for t in item["expression"].split(" + "))
        assert 0 <= a <= 9 and 0 <= b <= 9 and item["answer"] == a + b
    direct = [i for i in items if len(env.oracle_messages(i)) == 3]
    assert all(i["easy"] for i in direct) and 0.35 < len(direct) / len(easy) < 0.65
    messages = env.oracle_messages(direct[0])
    assert messages[-1] == {"role": "assistant", "content": f"<answer>{direct[0]['answer']}</answer>"}
    rollout = Rollout(messages=messages, tools=None, stop="answer",
                      turns=[turn(messages[-1]["content"])])
    assert env.compute_turn_rewards(direct[0], rollout) == [1.0]
    assert env.rollout_metrics(direct[0], rollout, [1.0])["direct_answer"] == 1.0


def test_a_careless_demonstrator_slips_one_digit_and_earns_what_it_did():
    """``oracle_slip_fraction``: that share of the demonstrations calls the calculator with
    one operand digit mistyped and copies the (wrong) result; the rewards score the slip as
    what it is, a wrong call and a wrong answer. The same item always gets the same one."""
    env = ArithmeticToolEnv(ArithmeticToolConfig(seed=5, oracle_slip_fraction=0.4,
                                                 operators=["+", "-", "*", "//", "%"]))
    items = [asyncio.run(env.get_next_item()) for _ in range(1000)]
    slipped = 0
    for item in items:
        messages = env.oracle_messages(item)
        assert messages == env.oracle_messages(item)
        [call] = get_parser("hermes").parse(messages[2]["content"]).calls
        typed = call.arguments["expression"]
        result = evaluate_expression(typed)  # it runs: no leading zero, no zero divisor
        assert messages[3]["content"] == str(result)
        assert messages[4]["content"] == f"<answer>{result}</answer>"
        if typed == item["expression"]:
            continue
        slipped += 1
        diff = [(a, b) for a, b in zip(typed, item["expression"]) if a != b]
        assert len(typed) == len(item["expression"]) and len(diff) == 1 and diff[0][0].isdigit()
        rollout = Rollout(messages=messages, tools=None, stop="answer", turns=[
            turn(messages[2]["content"], [call], results=[messages[3]["content"]]),
            turn(messages[4]["content"])])
        expected_outcome = 1.0 if result == item["answer"] else 0.1  # 3 * 0 = 3 * 5
        assert env.compute_turn_rewards(item, rollout) == [0.0, expected_outcome]
    assert 0.35 < slipped / len(items) < 0.45
    careful = ArithmeticToolEnv(ArithmeticToolConfig(seed=5))  # the default: no slips
    assert all(f'"{i["expression"]}"' in careful.oracle_messages(i)[2]["content"] for i in items)


def test_word_problems_reward_the_storys_numbers_in_either_order_and_guessers_miss():
    """``question_style: words``: the expression is read out of a story; a call with the
    story's two numbers and the right value is the right call in either order, one with
    another number is not (even with the right value). ``oracle_guess_fraction``: that
    share of demonstrations answers at once with a near miss, which scores as a wrong
    answer on its only turn."""
    env = ArithmeticToolEnv(ArithmeticToolConfig(seed=2, question_style="words",
                                                 oracle_guess_fraction=0.5))
    items = [asyncio.run(env.get_next_item()) for _ in range(400)]
    assert {i["expression"].split()[1] for i in items} == {"+", "-", "*"}
    for item in items:
        a, op, b = item["expression"].split()
        assert a in item["question"] and b in item["question"]
        assert op not in item["question"] and item["answer"] >= 0
    product = next(i for i in items if " * " in i["expression"])
    a, _, b = product["expression"].split()

    def score(expression: str) -> float:
        call = ParsedToolCall("calculator", {"expression": expression}, "")
        rollout = Rollout(messages=[], tools=None, stop="answer", truncated=False, turns=[
            turn("", [call], results=[str(product["answer"])]),
            turn(f"<answer>{product['answer']}</answer>")])
        return env.compute_turn_rewards(product, rollout)[0]

    assert score(f"{a} * {b}") == score(f"{b}*{a}") == 1.0
    assert score(f"{a} + {b}") == 0.0
    assert score(f"{product['answer']} * 1") == 0.0  # the right value, not the story's numbers
    guessed = [i for i in items if len(env.oracle_messages(i)) == 3]
    assert 0.4 < len(guessed) / len(items) < 0.6
    for item in guessed:
        answer = env.oracle_messages(item)[-1]["content"]
        rollout = Rollout(messages=[], tools=None, stop="answer", truncated=False,
                          turns=[turn(answer)])
        assert env.compute_turn_rewards(item, rollout) == [0.1]
        assert env.rollout_metrics(item, rollout, [0.1])["direct_answer"] == 1.0
