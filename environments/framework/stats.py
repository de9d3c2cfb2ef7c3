"""Confidence intervals for evaluation figures (pure functions)."""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054
"""The standard normal's 97.5th percentile."""


def ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """95 % confidence interval of the mean of ``values`` (None when empty).

    All values 0 or 1 (a rate, e.g. answer accuracy): the Wilson score interval, with
    ``p`` the observed rate, ``n`` the count and ``z = 1.96``::

        (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)

    which stays inside [0, 1] and is sensible at p = 0 or 1. Otherwise the normal
    approximation ``mean ± z·s/sqrt(n)`` (``s`` the sample standard deviation).
    """
    n = len(values)
    if n == 0:
        return None
    mean = sum(values) / n
    z = Z95
    if all(v in (0, 1) for v in values):
        centre = mean + z * z / (2 * n)
        half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n))
        scale = 1 + z * z / n
        return (max(0.0, (centre - half) / scale), min(1.0, (centre + half) / scale))
    if n == 1:
        return (mean, mean)
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return (mean - z * s / math.sqrt(n), mean + z * s / math.sqrt(n))
