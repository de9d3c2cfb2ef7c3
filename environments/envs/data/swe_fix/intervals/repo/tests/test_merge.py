import unittest

from intervals import merge, overlaps, total_length


class TestMerge(unittest.TestCase):
    def test_empty(self):
        self.assertEqual(merge([]), [])

    def test_sorted_overlapping(self):
        self.assertEqual(merge([(1, 3), (2, 6), (8, 10)]), [(1, 6), (8, 10)])

    def test_touching_intervals_join(self):
        self.assertEqual(merge([(1, 3), (3, 5)]), [(1, 5)])

    def test_nested_interval_absorbed(self):
        self.assertEqual(merge([(1, 10), (2, 3), (4, 12)]), [(1, 12)])

    def test_rejects_reversed_interval(self):
        with self.assertRaises(ValueError):
            merge([(5, 1)])

    def test_input_not_modified(self):
        intervals = [(8, 10), (1, 3)]
        merge(intervals)
        self.assertEqual(intervals, [(8, 10), (1, 3)])

    def test_unsorted_input(self):
        self.assertEqual(merge([(8, 10), (1, 3), (2, 6)]), [(1, 6), (8, 10)])
        self.assertEqual(merge([(5, 6), (1, 5)]), [(1, 6)])


class TestMeasure(unittest.TestCase):
    def test_overlaps(self):
        self.assertTrue(overlaps((1, 3), (3, 4)))
        self.assertFalse(overlaps((1, 3), (4, 5)))

    def test_total_length_sorted(self):
        self.assertEqual(total_length([(0, 2), (1, 4)]), 4)

    def test_total_length_counts_overlap_once(self):
        self.assertEqual(total_length([(10, 20), (0, 5), (3, 12)]), 20)


if __name__ == "__main__":
    unittest.main()
