"""Counts over the words of a text."""

from collections import Counter

from textstats.tokenize import words


def word_count(text):
    return len(words(text))


def average_word_length(text):
    """Mean length of the words of ``text`` (0.0 when there are none)."""
    found = words(text)
    return sum(map(len, found)) / len(found) if found else 0.0


def frequencies(text):
    """How often each word occurs, ignoring case: a Counter of lowercase words."""
    return Counter(words(text))


def top_words(text, n=10):
    """The ``n`` most frequent words (lowercase) with their counts, most frequent first;
    ties in alphabetical order."""
    counts = frequencies(text)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]
