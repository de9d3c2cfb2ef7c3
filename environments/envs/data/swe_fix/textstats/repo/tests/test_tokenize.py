import unittest

from textstats import sentences, words


class TestWords(unittest.TestCase):
    def test_punctuation_dropped(self):
        self.assertEqual(words("Hello, world!"), ["Hello", "world"])

    def test_keeps_case(self):
        self.assertEqual(words("The Cat"), ["The", "Cat"])

    def test_apostrophes(self):
        self.assertEqual(words("don't stop 'quoted'"), ["don't", "stop", "quoted"])


class TestSentences(unittest.TestCase):
    def test_split(self):
        self.assertEqual(sentences("One. Two? Three!  Four"), ["One.", "Two?", "Three!", "Four"])


if __name__ == "__main__":
    unittest.main()
