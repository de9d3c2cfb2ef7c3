"""Word problems for ``arithmetic_tool`` (``question_style: words``): the expression is
not written in the question; the model has to read it out of a sentence.

Each template tells a short story with two numbers and one operation. The item's
expression keeps the numbers in the order the story gives them (``a * b`` for "a boxes
of b pens"), but any call with the question's two numbers and the right value counts
(``b * a`` does too): the turn is rewarded for understanding the story, not for one
spelling of it.
"""

from __future__ import annotations

import random

# (operator, template): {a} and {b} are the numbers, in this order in the expression.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("*", "A box holds {b} pencils. How many pencils are in {a} boxes?"),
    ("*", "A bus has {a} rows with {b} seats in each row. How many seats does it have?"),
    ("*", "Tom reads {b} pages a day for {a} days. How many pages does he read?"),
    ("*", "Each of {a} baskets has {b} apples. How many apples are there in all?"),
    ("*", "A ticket costs {b} dollars. What do {a} tickets cost?"),
    ("+", "Mia has {a} stickers and her friend gives her {b} more. How many stickers does "
          "Mia have now?"),
    ("+", "A farm has {a} sheep and {b} goats. How many animals is that?"),
    ("+", "A library had {a} books and bought {b} new ones. How many books does it have?"),
    ("-", "A tank holds {a} liters of water. {b} liters leak out. How many liters are "
          "left?"),
    ("-", "Sam had {a} dollars and spent {b} dollars. How many dollars does he have left?"),
    ("-", "A school has {a} students and {b} of them are on a trip. How many students are "
          "at school?"),
)


def word_problem(rng: random.Random, max_operand: int, operators: list[str]) -> tuple[str, str]:
    """``(question, expression)``: a story drawn from the templates of ``operators``;
    products take two numbers in ``[2, max_operand]``, sums and differences in
    ``[10, max_operand * 10]`` (a difference never below zero)."""
    choices = [t for t in TEMPLATES if t[0] in operators]
    if not choices:
        raise ValueError(f"operators {operators}: word problems exist for + - * only")
    op, template = rng.choice(choices)
    if op == "*":
        a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
    else:
        a, b = rng.randint(10, max_operand * 10), rng.randint(10, max_operand * 10)
        if op == "-" and b > a:
            a, b = b, a
    return template.format(a=a, b=b), f"{a} {op} {b}"


def mental_guess(answer: int, rng: random.Random) -> int:
    """A number a person (or a small model) might give without computing: off from
    ``answer`` by 2-15 %, never ``answer`` itself (the base model's own slips look like
    this: "17 * 23 = 381")."""
    if abs(answer) < 20:  # too small for a relative slip
        return answer + rng.choice((1, 2, 3)) if answer < 3 else answer + rng.choice((-2, -1, 1, 2))
    while True:
        guess = round(answer * (1 + rng.choice((-1, 1)) * rng.uniform(0.02, 0.15)))
        if guess != answer and guess >= 0:
            return guess
