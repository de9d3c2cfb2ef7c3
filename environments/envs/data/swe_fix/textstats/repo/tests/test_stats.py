import unittest

from textstats import average_word_length, frequencies, top_words, word_count


class TestCounts(unittest.TestCase):
    def test_word_count(self):
        self.assertEqual(word_count("Hello, world! It's a test."), 5)
        self.assertEqual(word_count(""), 0)

    def test_average_word_length(self):
        self.assertEqual(average_word_length("ab abcd"), 3.0)
        self.assertEqual(average_word_length("..."), 0.0)

    def test_frequencies_ignore_case(self):
        counts = frequencies("Dog dog DOG cat")
        self.assertEqual(counts["dog"], 3)
        self.assertNotIn("Dog", counts)


class TestTopWords(unittest.TestCase):
    def test_most_frequent_first(self):
        self.assertEqual(top_words("a b b c c c", 2), [("c", 3), ("b", 2)])

    def test_ties_alphabetical(self):
        self.assertEqual(top_words("pear apple fig", 3), [("apple", 1), ("fig", 1), ("pear", 1)])

    def test_ignores_case(self):
        self.assertEqual(top_words("The cat saw the dog. The dog ran.", 2),
                         [("the", 3), ("dog", 2)])


if __name__ == "__main__":
    unittest.main()
