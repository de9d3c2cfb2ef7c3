"""TextWorld game files with a Gymnasium-style API (``gym:textworld/PATH``,
:mod:`environments.adapters.gym_env`): :class:`TextWorldGame`, and what of a model's reply
the game is sent (:func:`textworld_command`) and what of its feedback is kept
(:func:`clean_textworld_feedback`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_BANNER_LINE = re.compile(r"^[\s$\\|_/<>()]*[$\\|_/][\s$\\|_/<>()]*$")


_NOT_GAME_TEXT = re.compile(r"[^\x20-\x5b\x5d-\x7e]+")  # printable ASCII but the backslash
MAX_COMMAND_CHARS = 200
FILE_VERBS = frozenset({"save", "restore", "script", "transcript", "unscript", "noscript",
                        "recording", "replay"})
"""The interpreter's verbs that write or read files in the env server's working directory
(a saved game, a transcript, a command recording): never sent."""


def textworld_command(text: str) -> str:
    """What of a model's reply a TextWorld game is sent: its first line with anything on
    it once backslashes and what is not printable ASCII are made spaces, whitespace
    collapsed, at most ``MAX_COMMAND_CHARS`` characters. The Z-machine interpreter
    (Jericho's frotz) reads a backslash as the start of one of its own hotkey commands and
    then waits for keys that never come (the env server hangs), and random replies
    (backslashes, control and non-ASCII characters, many lines) crashed it with SIGSEGV
    in 3 of 4 runs of 300 steps, where the same replies cleaned ran 2,400 steps. A reply
    that starts with one of ``FILE_VERBS`` is sent as an empty command: frotz's ``save``
    and ``script`` wrote files into the env server's working directory. Commands in the
    game's own vocabulary (lowercase ASCII words) pass unchanged."""
    for line in text.splitlines():
        if command := " ".join(_NOT_GAME_TEXT.sub(" ", line).split()):
            if command.split()[0].lower() in FILE_VERBS:
                return ""  # (the game answers "I beg your pardon?")
            return command[:MAX_COMMAND_CHARS]
    return ""


def clean_textworld_feedback(text: str) -> str:
    """TextWorld's feedback without the interpreter's decorations: the title banner, the
    ``>`` prompt and the status line after it, the restart question at the end, runs of
    blank lines."""
    text = text.rsplit("\n>", 1)[0] if "\n>" in text else text
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if not _BANNER_LINE.match(line)
             and not line.startswith("Would you like to RESTART")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


class TextWorldGame:
    """A TextWorld game file with a Gymnasium-style API (TextWorld's own is
    ``step(command) -> (GameState, total score, done)``).

    ``reward`` is the score's increment (over ``max_score`` with ``normalize_score``);
    ``terminated`` when the game is won or lost; ``truncated`` after ``max_steps`` steps.
    ``info`` carries ``admissible_commands``, ``won``, ``lost``, ``score``, ``max_score``,
    ``moves``, ``inventory``, and ``policy_commands`` (the game's planner, re-planned from
    the current state) with ``policy_commands=True``."""

    def __init__(self, path: str | Path, *, max_steps: int | None = None,
                 normalize_score: bool = False, policy_commands: bool = False,
                 inventory: bool = True):
        try:
            import textworld
        except ImportError:
            raise ImportError("TextWorld games need textworld: pip install "
                              "'lachesis-rl[gym]' (or textworld==1.7.0)") from None
        self.path = Path(path)
        self.max_steps = max_steps
        self.normalize_score = normalize_score
        infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, score=True,
                                   max_score=True, moves=True, objective=True,
                                   inventory=inventory, policy_commands=policy_commands)
        self._keys = [k for k in ("admissible_commands", "won", "lost", "score", "max_score",
                                  "moves", "objective", "inventory", "policy_commands")
                      if getattr(infos, k)]
        self._env = textworld.start(str(self.path), request_infos=infos)
        self._score = 0
        self._steps = 0

    def _info(self, state: Any) -> dict[str, Any]:
        info = {k: state[k] for k in self._keys}
        if isinstance(info.get("inventory"), str):
            info["inventory"] = clean_textworld_feedback(info["inventory"])
        return info

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        state = self._env.reset()  # a game file is one game: the seed changes nothing
        self._score, self._steps = state["score"], 0
        return clean_textworld_feedback(state.feedback), self._info(state)

    def step(self, command: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        state, score, done = self._env.step(textworld_command(command))
        reward = float(score - self._score)
        if self.normalize_score:
            reward /= max(1, state["max_score"])
        self._score = score
        self._steps += 1
        truncated = not done and self.max_steps is not None and self._steps >= self.max_steps
        return clean_textworld_feedback(state.feedback), reward, bool(done), truncated, \
            self._info(state)

    def close(self) -> None:
        self._env.close()


