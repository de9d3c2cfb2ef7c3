import unittest

from semverlib import InvalidVersion, Version, compare, parse


class TestParse(unittest.TestCase):
    def test_core(self):
        v = parse("1.22.333")
        self.assertEqual((v.major, v.minor, v.patch), (1, 22, 333))
        self.assertEqual(v.prerelease, ())

    def test_prerelease_and_build(self):
        v = parse("1.0.0-rc.1+build.5")
        self.assertEqual(v.prerelease, ("rc", "1"))
        self.assertEqual(v.build, ("build", "5"))
        self.assertEqual(str(v), "1.0.0-rc.1+build.5")

    def test_invalid(self):
        for text in ["1.2", "01.2.3", "1.2.3-", "v1.2.3", ""]:
            with self.assertRaises(InvalidVersion, msg=text):
                parse(text)


class TestCompare(unittest.TestCase):
    def test_core_order(self):
        self.assertLess(parse("1.2.3"), parse("1.10.0"))
        self.assertLess(parse("1.9.9"), parse("2.0.0"))
        self.assertEqual(compare("2.1.1", "2.1.0"), 1)

    def test_numeric_identifiers(self):
        self.assertLess(parse("1.0.0-alpha.2"), parse("1.0.0-alpha.10"))
        self.assertLess(parse("1.0.0-alpha.1"), parse("1.0.0-alpha.beta"))

    def test_build_metadata_ignored(self):
        self.assertEqual(parse("1.0.0+a"), parse("1.0.0+b"))
        self.assertEqual(compare("1.0.0-rc.1+x", "1.0.0-rc.1"), 0)

    def test_prerelease_sorts_before_release(self):
        self.assertLess(parse("1.0.0-alpha"), parse("1.0.0"))
        self.assertEqual(compare("2.0.0", "2.0.0-rc.1"), 1)

    def test_spec_example_order(self):
        order = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta",
                 "1.0.0-beta.2", "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0"]
        shuffled = order[3:] + order[:3]
        self.assertEqual([str(v) for v in sorted(map(parse, shuffled))], order)

    def test_hash_matches_equality(self):
        self.assertEqual(len({parse("1.0.0+a"), parse("1.0.0+b"), Version(1, 0, 0)}), 1)


if __name__ == "__main__":
    unittest.main()
