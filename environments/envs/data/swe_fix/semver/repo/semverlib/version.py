"""Semantic versions (https://semver.org/): parsing and precedence."""

import re
from functools import total_ordering

_PATTERN = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$")


class InvalidVersion(ValueError):
    """The text is not a semantic version."""


def _identifier_key(identifier):
    # Numeric identifiers compare numerically and sort before alphanumeric ones.
    if identifier.isdigit():
        return (0, int(identifier), "")
    return (1, 0, identifier)


@total_ordering
class Version:
    def __init__(self, major, minor, patch, prerelease=(), build=()):
        self.major = major
        self.minor = minor
        self.patch = patch
        self.prerelease = tuple(prerelease)
        self.build = tuple(build)

    def _key(self):
        return (self.major, self.minor, self.patch,
                tuple(_identifier_key(p) for p in self.prerelease))

    def __eq__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self):
        return hash(self._key())

    def __str__(self):
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def __repr__(self):
        return f"Version({str(self)!r})"


def parse(text):
    """The Version of ``text`` ("1.2.3", "1.0.0-rc.1+build.5"); InvalidVersion if none."""
    match = _PATTERN.match(text.strip())
    if match is None:
        raise InvalidVersion(f"not a semantic version: {text!r}")
    major, minor, patch, pre, build = match.groups()
    return Version(int(major), int(minor), int(patch),
                   pre.split(".") if pre else (), build.split(".") if build else ())


def compare(a, b):
    """-1, 0 or 1 as version ``a`` is lower than, equal to or higher than ``b``."""
    a, b = parse(a), parse(b)
    return (a > b) - (a < b)
