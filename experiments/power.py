"""Power of the confirmatory study's primary tests, from the first study's per-seed spread
(docs/results.md, "Credit assignment: the pre-registered experiment", per-seed table).

    python experiments/power.py

Collapse (final tool success < 0.5): the exact power of Fisher's two-sided test, summing
over every outcome of two binomials. Answer accuracy: the power of the Mann-Whitney test
by resampling each arm's 5 observed per-seed accuracies (a crude model of the spread:
5 values per arm). Both at alpha 0.05 and at the Holm worst case 0.05 / 3.
"""

from __future__ import annotations

import random
import sys
from math import comb
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import fisher_exact, mann_whitney  # noqa: E402

# first study, final tool success and answer accuracy per seed 0..4 (docs/results.md)
TOOL = {"grpo": [0.88, 0.00, 0.88, 0.00, 0.71], "grpo_merged": [0.86, 0.59, 0.84, 0.88, 0.88],
        "mt_grpo": [0.86, 0.86, 0.85, 0.88, 0.88], "turn_rtg": [0.37, 0.92, 0.88, 0.88, 0.85],
        "turn_prefix": [0.89, 0.91, 0.85, 0.84, 0.89]}
ACCURACY = {"grpo": [0.68, 0.05, 0.67, 0.00, 0.38], "mt_grpo": [0.73, 0.66, 0.66, 0.66, 0.73],
            "turn_rtg": [0.27, 0.76, 0.72, 0.51, 0.55]}
COLLAPSE_BELOW = 0.5
SEEDS = [16, 20, 24, 32, 40]
ALPHAS = [0.05, 0.05 / 3]


def fisher_power(p1: float, p2: float, n: int, alpha: float) -> float:
    """P(Fisher's two-sided p <= alpha) when each arm's n seeds collapse independently."""
    def pmf(k: int, p: float) -> float:
        return comb(n, k) * p**k * (1 - p) ** (n - k)

    return sum(pmf(x1, p1) * pmf(x2, p2) for x1 in range(n + 1) for x2 in range(n + 1)
               if fisher_exact(x1, n - x1, x2, n - x2) <= alpha)


def resampled_power(x: list[float], y: list[float], n: int, alpha: float,
                    reps: int = 2000, seed: int = 0) -> float:
    rng = random.Random(seed)
    hits = sum(mann_whitney(rng.choices(x, k=n), rng.choices(y, k=n))[1] <= alpha
               for _ in range(reps))
    return hits / reps


def main() -> None:
    rates = {arm: sum(v < COLLAPSE_BELOW for v in values) / len(values)
             for arm, values in TOOL.items()}
    turn_level = [v for arm, values in TOOL.items() if arm != "grpo" for v in values]
    pooled = sum(v < COLLAPSE_BELOW for v in turn_level) / len(turn_level)
    print("first study, collapse (final tool success < 0.5) per arm:",
          ", ".join(f"{arm} {rate:.2f}" for arm, rate in rates.items()),
          f"; turn-level arms pooled {pooled:.2f} ({len(turn_level)} seeds)")
    scenarios = [("observed: 0.40 vs 0.05 (pooled turn-level)", 0.40, pooled),
                 ("pessimistic: 0.30 vs 0.05", 0.30, 0.05),
                 ("pessimistic: 0.40 vs 0.10", 0.40, 0.10)]
    print("\nFisher's exact test, power for collapse, per arm vs GRPO-OR")
    print("| scenario | alpha | " + " | ".join(f"n={n}" for n in SEEDS) + " |")
    print("|---|---|" + "---:|" * len(SEEDS))
    for label, p1, p2 in scenarios:
        for alpha in ALPHAS:
            print(f"| {label} | {alpha:.4f} | " + " | ".join(
                f"{fisher_power(p1, p2, n, alpha):.2f}" for n in SEEDS) + " |")
    print("\nMann-Whitney test, power for final answer accuracy vs GRPO-OR "
          "(resampling the first study's 5 seeds, 2000 draws)")
    print("| arm | alpha | " + " | ".join(f"n={n}" for n in SEEDS) + " |")
    print("|---|---|" + "---:|" * len(SEEDS))
    for arm in ["mt_grpo", "turn_rtg"]:
        for alpha in ALPHAS:
            print(f"| {arm} | {alpha:.4f} | " + " | ".join(
                f"{resampled_power(ACCURACY[arm], ACCURACY['grpo'], n, alpha):.2f}"
                for n in SEEDS) + " |")


if __name__ == "__main__":
    main()
