"""Splitting text into words and sentences."""

import re

_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def words(text):
    """The words of ``text`` in order, as written (case kept, punctuation dropped;
    "don't" is one word)."""
    return _WORD.findall(text)


def sentences(text):
    """The sentences of ``text`` (split after ".", "!" or "?"), stripped."""
    return [s.strip() for s in _SENTENCE_END.split(text.strip()) if s.strip()]
