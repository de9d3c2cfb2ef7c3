"""Demonstrators of GEM's games (gem-llm 0.1.0, played as shipped through ``gym:gem/ID``),
for the gym adapter's ``demonstrator`` and ``demonstrator_noise`` settings
(:mod:`environments.adapters.gym_demonstrator`). They read only what the model reads: the
conversation's text.

* ``guess_the_number``: binary search for ``game:GuessTheNumber-v0-*``: the middle of the
  range every hint so far leaves (on the easy game, 1-10, it wins within GEM's 4 guesses;
  on the hard one, 1-50, within its 7). ``guess_the_number_noise``: a number of the range
  drawn uniformly.
* ``mastermind``: a consistent-code solver for ``game:Mastermind-v0-*``: the first code, in
  lexicographic order, that gives every earlier guess the pegs it got and was not guessed
  yet (on the easy game, 2 digits of 1-6, it wins in at most 6 guesses of GEM's 10).
  ``mastermind_noise``: a code drawn uniformly (it may repeat a guess, which GEM answers
  "already guessed" and scores 0).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from typing import Any

_RANGE = re.compile(r"guess the number between (\d+) and (\d+)")
_HINT = re.compile(r"you guessed (\d+), and the target number is (higher|lower) than")
_RULES = re.compile(r"guess the secret (\d+) digit code.*?digits from 1 to (\d+).*?"
                    r"Duplicate numbers are (allowed|not allowed)", re.S)
_FEEDBACK = re.compile(r"you guessed \[([\d, ]+)\]\. This guess receives (\d+) black "
                       r"peg\(s\) and (\d+) white peg\(s\)")
_BOXED = re.compile(r"\\boxed\{(\d+(?:\s+\d+)*)\}")


def _first_observation(history: list[dict[str, Any]]) -> str:
    return next((m["content"] for m in history if m["role"] == "user"), "")


def number_range(history: list[dict[str, Any]]) -> tuple[int, int]:
    """GuessTheNumber's range, as its first observation states it."""
    found = _RANGE.search(_first_observation(history))
    if found is None:
        raise ValueError("guess_the_number demonstrator: the conversation does not start "
                         "with GEM GuessTheNumber's rules (\"guess the number between A and "
                         "B\")")
    return int(found[1]), int(found[2])


def guess_the_number(observation: str, info: dict[str, Any],
                     history: list[dict[str, Any]]) -> str:
    """Binary search: the middle of what the hints so far leave of the range
    (``\\boxed{5}``)."""
    low, high = number_range(history)
    for m in history:
        if m["role"] == "user":
            for guess, hint in _HINT.findall(m["content"]):
                if hint == "higher":
                    low = max(low, int(guess) + 1)
                else:
                    high = min(high, int(guess) - 1)
    return "\\boxed{" + str((low + high) // 2 if low <= high else low) + "}"


def guess_the_number_noise(observation: str, info: dict[str, Any],
                           history: list[dict[str, Any]], pick: float) -> str:
    """The ``pick``-th share of the range: a uniformly drawn guess."""
    low, high = number_range(history)
    return "\\boxed{" + str(low + int(pick * (high - low + 1))) + "}"


def mastermind_codes(history: list[dict[str, Any]]) -> list[tuple[int, ...]]:
    """Every code the game's rules (stated in its first observation) allow, in
    lexicographic order."""
    rules = _RULES.search(_first_observation(history))
    if rules is None:
        raise ValueError("mastermind demonstrator: the conversation does not start with GEM "
                         "Mastermind's rules (\"guess the secret N digit code ... digits from "
                         "1 to M ... Duplicate numbers are ...\")")
    length, digits, duplicates = int(rules[1]), int(rules[2]), rules[3] == "allowed"
    symbols = range(1, digits + 1)
    codes = itertools.product(symbols, repeat=length) if duplicates else \
        itertools.permutations(symbols, length)
    return list(codes)


def pegs(secret: tuple[int, ...], guess: tuple[int, ...]) -> tuple[int, int]:
    """Mastermind's (black, white) pegs of ``guess`` against ``secret``."""
    black = sum(s == g for s, g in zip(secret, guess))
    common = sum((Counter(secret) & Counter(guess)).values())
    return black, common - black


def mastermind(observation: str, info: dict[str, Any],
               history: list[dict[str, Any]]) -> str | None:
    """The first code consistent with every peg count so far, not guessed yet, as GEM
    reads a guess (``\\boxed{1 2}``); None when none is left."""
    feedback = [(tuple(int(d) for d in guess.split(",")), (int(black), int(white)))
                for m in history if m["role"] == "user"
                for guess, black, white in _FEEDBACK.findall(m["content"])]
    guessed = {tuple(map(int, b.split())) for m in history if m["role"] == "assistant"
               for b in _BOXED.findall(m["content"])}
    for code in mastermind_codes(history):
        if code not in guessed and all(pegs(code, g) == p for g, p in feedback):
            return "\\boxed{" + " ".join(map(str, code)) + "}"
    return None


def mastermind_noise(observation: str, info: dict[str, Any], history: list[dict[str, Any]],
                     pick: float) -> str:
    """The ``pick``-th share of the allowed codes: a uniformly drawn guess."""
    codes = mastermind_codes(history)
    return "\\boxed{" + " ".join(map(str, codes[int(pick * len(codes))])) + "}"
