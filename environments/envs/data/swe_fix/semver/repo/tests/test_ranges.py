import unittest

from semverlib import satisfies


class TestSatisfies(unittest.TestCase):
    def test_simple_constraints(self):
        self.assertTrue(satisfies("1.4.0", ">=1.2.0"))
        self.assertFalse(satisfies("1.1.9", ">=1.2.0"))
        self.assertTrue(satisfies("1.4.0", "1.4.0"))

    def test_combined_constraints(self):
        self.assertTrue(satisfies("1.5.0", ">=1.2.0, <2.0.0"))
        self.assertFalse(satisfies("2.0.0", ">=1.2.0, <2.0.0"))

    def test_prerelease_below_release(self):
        self.assertTrue(satisfies("2.0.0-rc.1", "<2.0.0"))
        self.assertFalse(satisfies("2.0.0-rc.1", ">=2.0.0"))


if __name__ == "__main__":
    unittest.main()
