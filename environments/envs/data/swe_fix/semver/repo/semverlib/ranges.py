"""Version constraints such as ">=1.2.0" or "<2.0.0"."""

import operator
import re

from semverlib.version import parse

_OPERATORS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
              "==": operator.eq, "=": operator.eq}
_CONSTRAINT = re.compile(r"^\s*(>=|<=|>|<|==|=)?\s*(\S+)\s*$")


def satisfies(version, spec):
    """Whether ``version`` meets every comma-separated constraint of ``spec``."""
    version = parse(version)
    for part in spec.split(","):
        match = _CONSTRAINT.match(part)
        if match is None:
            raise ValueError(f"bad constraint: {part!r}")
        op, bound = match.groups()
        if not _OPERATORS[op or "=="](version, parse(bound)):
            return False
    return True
