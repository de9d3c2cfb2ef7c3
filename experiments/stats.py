"""The studies' tests, written out (no scipy in the venv). The confirmatory study
(docs/study-credit-assignment.md): Fisher's exact test, the Mann-Whitney U test, Holm's
step-down adjustment, Wilson and t intervals. The stress study (docs/study-stress.md):
a permutation test stratified by warm start and an equivalence test (TOST) on the
stratified difference, with Student's t distribution.

tests/test_confirmatory.py and tests/test_stress.py check each against hand-computed
values or independent implementations written in the tests.
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


# --- the stress study (docs/study-stress.md): stratified permutation test, TOST ----------

def stratified_difference(x: list[list[float]], y: list[list[float]]) -> float:
    """The mean over strata of (mean of ``x`` − mean of ``y``) within the stratum: every
    stratum (warm start) weighs the same, whatever its number of runs."""
    return sum(sum(a) / len(a) - sum(b) / len(b) for a, b in zip(x, y)) / len(x)


def stratified_permutation(x: list[list[float]], y: list[list[float]], *,
                           draws: int = 100_000, seed: int = 0) -> tuple[float, float]:
    """``stratified_difference(x, y)`` and its two-sided permutation p: under the null the
    labels x/y are exchangeable within each stratum, never across strata. Exact (every
    relabelling of every stratum) when there are at most ``draws`` relabellings in all;
    otherwise ``draws`` random relabellings (``random.Random(seed)``), counting the
    observed one, ``p = (1 + #{|T*| >= |T|}) / (1 + draws)``."""
    import itertools
    import random

    if len(x) != len(y) or not x or any(not a or not b for a, b in zip(x, y)):
        raise ValueError("stratified_permutation: every stratum needs runs of both arms")
    observed = stratified_difference(x, y)
    tolerance = 1e-12 * max(1.0, abs(observed))
    strata = [(a + b, sum(a) + sum(b), len(a), len(b)) for a, b in zip(x, y)]

    def contribution(total: float, k: int, rest: int, picked: float) -> float:
        return picked / k - (total - picked) / rest

    relabellings = math.prod(comb(len(v), k) for v, _, k, _ in strata)
    if relabellings <= draws:  # every relabelling, once
        per_stratum = [[contribution(total, k, rest, sum(c))
                        for c in itertools.combinations(v, k)]
                       for v, total, k, rest in strata]
        hits = sum(abs(sum(parts) / len(strata)) >= abs(observed) - tolerance
                   for parts in itertools.product(*per_stratum))
        return observed, hits / relabellings
    rng = random.Random(seed)
    hits = 0
    for _ in range(draws):
        t = sum(contribution(total, k, rest, sum(rng.sample(v, k)))
                for v, total, k, rest in strata) / len(strata)
        hits += abs(t) >= abs(observed) - tolerance
    return observed, (1 + hits) / (1 + draws)


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified
    Lentz), converging for x < (a + 1) / (a + b + 2)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom:
    ``I_{df/(df+t²)}(df/2, 1/2) / 2`` for t >= 0, by symmetry below."""
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_quantile(q: float, df: float) -> float:
    """The q-quantile of Student's t (bisection on ``t_sf``)."""
    low, high = -1e3, 1e3
    for _ in range(200):
        mid = (low + high) / 2
        if 1.0 - t_sf(mid, df) < q:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def tost(x: list[list[float]], y: list[list[float]], margin: float,
         alpha: float = 0.05) -> dict[str, float]:
    """Two one-sided tests of equivalence for the stratified difference D of means
    (``stratified_difference``): H0 |Δ| >= ``margin`` against |Δ| < ``margin``. D's
    variance ``Σ_s (s²_xs/n_xs + s²_ys/n_ys) / S²`` (S strata), Welch-Satterthwaite
    degrees of freedom, ``p = max(P(T > (D + margin)/se), P(T > (margin − D)/se))``;
    equivalent at ``alpha`` exactly when the (1 − 2·alpha) interval lies inside
    ±margin. Returns the difference, that interval, se, df and p."""
    if any(len(a) < 2 or len(b) < 2 for a, b in zip(x, y)):
        raise ValueError("tost: every stratum needs at least 2 runs of each arm")
    strata = len(x)
    d = stratified_difference(x, y)
    parts = [statistics.variance(v) / len(v) / strata**2 for a, b in zip(x, y) for v in (a, b)]
    sizes = [len(v) for a, b in zip(x, y) for v in (a, b)]
    var = sum(parts)
    if var == 0:
        p = 0.0 if abs(d) < margin else 1.0
        return {"difference": d, "low": d, "high": d, "se": 0.0, "df": math.inf, "p": p}
    df = var**2 / sum(v**2 / (n - 1) for v, n in zip(parts, sizes))
    se = math.sqrt(var)
    p = max(t_sf((d + margin) / se, df), t_sf((margin - d) / se, df))
    half = t_quantile(1 - alpha, df) * se
    return {"difference": d, "low": d - half, "high": d + half, "se": se, "df": df, "p": p}
