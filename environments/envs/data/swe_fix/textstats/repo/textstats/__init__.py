"""Statistics about English text."""

from textstats.stats import average_word_length, frequencies, top_words, word_count
from textstats.tokenize import sentences, words

__all__ = ["average_word_length", "frequencies", "sentences", "top_words", "word_count",
           "words"]
