"""Semantic versions: parse, compare, check ranges."""

from semverlib.ranges import satisfies
from semverlib.version import InvalidVersion, Version, compare, parse

__all__ = ["InvalidVersion", "Version", "compare", "parse", "satisfies"]
