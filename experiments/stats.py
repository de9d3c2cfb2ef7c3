"""The confirmatory study's tests, written out (no scipy in the venv): Fisher's exact test,
the Mann-Whitney U test, Holm's step-down adjustment, Wilson and t intervals.

Registered in docs/study-credit-assignment.md; tests/test_confirmatory.py checks each
against hand-computed or brute-force values.
"""

from __future__ import annotations

import math
import statistics
from math import comb


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p of the 2x2 table ``[[a, b], [c, d]]`` (rows: arms; columns: collapsed,
    not): the probability, under fixed margins (hypergeometric), of every table no more
    likely than the observed one (the convention of R's fisher.test and scipy)."""
    row1, col1, n = a + b, a + c, a + b + c + d
    low, high = max(0, col1 - (n - row1)), min(row1, col1)

    def prob(x: int) -> float:
        return comb(col1, x) * comb(n - col1, row1 - x) / comb(n, row1)

    observed = prob(a)
    return min(1.0, sum(p for x in range(low, high + 1)
                        if (p := prob(x)) <= observed * (1 + 1e-7)))


def mann_whitney(x: list[float], y: list[float]) -> tuple[float, float]:
    """U of ``x`` (pairs with x > y, ties count 1/2) and its two-sided p from the normal
    approximation with the tie correction and a continuity correction of 1/2."""
    n1, n2 = len(x), len(y)
    pooled = sorted(x + y)
    ranks: dict[float, float] = {}
    i = 0
    ties = 0.0
    while i < len(pooled):
        j = i
        while j < len(pooled) and pooled[j] == pooled[i]:
            j += 1
        ranks[pooled[i]] = (i + 1 + j) / 2  # mean of ranks i+1..j
        ties += (j - i) ** 3 - (j - i)
        i = j
    u = sum(ranks[v] for v in x) - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var == 0:
        return u, 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(var)
    return u, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (family-wise error over the comparisons)."""
    order = sorted(pvalues, key=pvalues.get)
    adjusted, running = {}, 0.0
    for rank, key in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * pvalues[key]))
        adjusted[key] = running
    return adjusted


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float, float]:
    """A proportion and its 95 % Wilson score interval."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return p, max(0.0, centre - half), min(1.0, centre + half)


# two-sided 95 % quantiles of Student's t, by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042, 40: 2.021, 60: 2.000}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % t-interval ``mean ± t_{0.975, n-1} · s / sqrt(n)`` (conservative
    between table entries)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, mean, mean
    df = len(values) - 1
    t = T95[max(d for d in T95 if d <= df)]
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half
