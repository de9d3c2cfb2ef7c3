import unittest

from intervals import format_ranges, parse_ranges


class TestParse(unittest.TestCase):
    def test_parse_ranges(self):
        self.assertEqual(parse_ranges("1-3, 5-8"), [(1, 3), (5, 8)])

    def test_single_points(self):
        self.assertEqual(parse_ranges("4, 7-7,"), [(4, 4), (7, 7)])

    def test_round_trip(self):
        self.assertEqual(format_ranges(parse_ranges("1-3, 5, 9-12")), "1-3, 5, 9-12")


if __name__ == "__main__":
    unittest.main()
