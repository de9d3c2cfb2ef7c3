"""Power of the confirmatory study's primary tests, from the first study's per-seed spread
(docs/results.md, "Credit assignment: the pre-registered experiment", per-seed table); with
``--stress``, power of the stress study's tests (docs/study-stress.md), from the
confirmatory study's 128 runs.

    python experiments/power.py
    python experiments/power.py --stress

Collapse (final tool success < 0.5): the exact power of Fisher's two-sided test, summing
over every outcome of two binomials. Answer accuracy: the power of the Mann-Whitney test
by resampling each arm's 5 observed per-seed accuracies (a crude model of the spread:
5 values per arm). Both at alpha 0.05 and at the Holm worst case 0.05 / 3.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from math import comb
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import fisher_exact, mann_whitney, stratified_permutation, tost  # noqa: E402

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


# --- the stress study ----------------------------------------------------------------------

CONFIRMATORY = Path(__file__).resolve().parent / "results" / "confirmatory"
STRESS_DESIGN = (4, 8)  # warm starts, runs per arm and warm start
STRESS_ALPHAS = [0.05, 0.05 / 3]


def confirmatory_values(results: Path = CONFIRMATORY) -> dict[str, dict[str, list[float]]]:
    """Final answer accuracy and tool success of every kept confirmatory run, per arm."""
    values: dict[str, dict[str, list[float]]] = {}
    for summary in sorted(results.glob("*-seed*/summary.json")):
        arm = summary.parent.name.rsplit("-seed", 1)[0]
        after = json.loads(summary.read_text())["after"]["arithmetic_tool"]
        for key in ("correct", "tool_success"):
            values.setdefault(arm, {}).setdefault(key, []).append(float(after[key]))
    return values


def stratified_power(x: list[float], y: list[float], alphas: list[float], *, shift: float = 0.0,
                     sims: int = 300, draws: int = 400, seed: int = 0) -> list[float]:
    """P(stratified permutation p <= alpha), each alpha, when each of the design's warm
    starts gets runs resampled from ``x`` and from ``y`` (``y`` moved up by ``shift``)."""
    rng = random.Random(seed)
    strata, n = STRESS_DESIGN
    ps = []
    for i in range(sims):
        xs = [rng.choices(x, k=n) for _ in range(strata)]
        ys = [[v + shift for v in rng.choices(y, k=n)] for _ in range(strata)]
        ps.append(stratified_permutation(xs, ys, draws=draws, seed=seed * sims + i)[1])
    return [sum(p <= alpha for p in ps) / sims for alpha in alphas]


def tost_power(pool: list[float], delta: float, margin: float, alphas: list[float], *,
               sims: int = 2000, seed: int = 0) -> list[float]:
    """P(TOST declares equivalence) when both arms' runs are resampled from ``pool``, one
    moved up by ``delta`` (the true difference)."""
    rng = random.Random(seed)
    strata, n = STRESS_DESIGN
    ps = [tost([rng.choices(pool, k=n) for _ in range(strata)],
               [[v + delta for v in rng.choices(pool, k=n)] for _ in range(strata)],
               margin)["p"] for _ in range(sims)]
    return [sum(p <= alpha for p in ps) / sims for alpha in alphas]


def stress() -> None:
    values = confirmatory_values()
    acc = {arm: v["correct"] for arm, v in values.items()}
    strata, n = STRESS_DESIGN
    print(f"stress study design: {strata} warm starts x {n} runs per arm; resampling the "
          f"confirmatory study's runs ({', '.join(f'{a} {len(v)}' for a, v in acc.items())})")
    print("confirmatory accuracy, mean / sd: " + ", ".join(
        f"{a} {statistics.mean(v):.3f} / {statistics.stdev(v):.3f}" for a, v in acc.items()))
    print("\nStratified permutation test, final accuracy vs GRPO-OR (300 simulated studies, "
          "400 relabellings each); GRPO-OR's runs moved up so that the gap is a fraction "
          "of the confirmatory one")
    print("| arm | gap in the confirmatory study | fraction of the gap | true gap | "
          + " | ".join(f"power at {a:.4f}" for a in STRESS_ALPHAS) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(STRESS_ALPHAS))
    for arm in ["mt_grpo", "gigpo", "turn_rtg"]:
        gap = statistics.mean(acc[arm]) - statistics.mean(acc["grpo"])
        for fraction in (1.0, 0.5, 0.25):
            power = stratified_power(acc[arm], acc["grpo"], STRESS_ALPHAS,
                                     shift=(1 - fraction) * gap)
            print(f"| {arm} | {gap:.3f} | {fraction:.2f} | {fraction * gap:.3f} | "
                  + " | ".join(f"{p:.2f}" for p in power) + " |")
    tool = {arm: [float(t < COLLAPSE_BELOW) for t in v["tool_success"]]
            for arm, v in values.items()}
    power = stratified_power(tool["grpo"], tool["mt_grpo"], STRESS_ALPHAS)
    print(f"\nCollapse (secondary), the same test on collapse indicators, GRPO-OR "
          f"({sum(tool['grpo']):.0f}/{len(tool['grpo'])}) vs MT-GRPO "
          f"({sum(tool['mt_grpo']):.0f}/{len(tool['mt_grpo'])}) as observed: power "
          + ", ".join(f"{p:.2f} at {a:.4f}" for p, a in zip(power, STRESS_ALPHAS)))
    pool = [v for arm in ["mt_grpo", "gigpo", "turn_rtg"] for v in acc[arm]]
    print(f"\nTOST between two non-baseline arms, both resampled from the pooled "
          f"MT-GRPO, GiGPO and turn-RTG runs ({len(pool)}, sd {statistics.stdev(pool):.3f}), "
          "2000 simulated studies: P(equivalence shown)")
    print("| margin | true difference | " + " | ".join(f"alpha {a:.4f}" for a in STRESS_ALPHAS)
          + " |")
    print("|---:|---:|" + "---:|" * len(STRESS_ALPHAS))
    for margin in (0.05, 0.08, 0.10):
        for delta in (0.0, 0.02, 0.04):
            power = tost_power(pool, delta, margin, STRESS_ALPHAS)
            print(f"| {margin:.2f} | {delta:.2f} | " + " | ".join(f"{p:.2f}" for p in power)
                  + " |")


# --- study 3 (TextWorld, two horizons) ---------------------------------------------------------

PILOTS = {"short": Path(__file__).resolve().parent / "results" / "textworld-credit-pilot",
          "long": Path(__file__).resolve().parent / "results" / "textworld-credit-pilot-long"}


def pilot_spread(results: Path) -> dict[str, Any]:
    """A pilot's final held-out success per arm (its tuning cells: one warm start, one
    rate, several seeds) and the pooled within-arm standard deviation."""
    arms: dict[str, list[float]] = {}
    for summary in sorted(results.glob("tuning/*/*-seed*/summary.json")):
        after = json.loads(summary.read_text())["after"]["textworld_cooking"]
        arms.setdefault(summary.parent.name.rsplit("-seed", 1)[0], []).append(
            float(after["success"]))
    groups = [v for v in arms.values() if len(v) >= 2]
    df = sum(len(v) - 1 for v in groups)
    sd = (math.sqrt(sum((len(v) - 1) * statistics.variance(v) for v in groups) / df)
          if df else float("nan"))
    return {"runs": arms, "sd": sd, "df": df}


def normal_power(sd: float, delta: float, strata: int, n: int, alphas: list[float], *,
                 sims: int = 400, draws: int = 400, seed: int = 0) -> list[float]:
    """P(stratified permutation p <= alpha) when each of ``strata`` warm starts has ``n``
    runs per arm, final success ~ N(mu_ws, sd) for one arm and N(mu_ws + delta, sd) for
    the other (mu_ws: a warm start's own level, which a stratified test removes)."""
    rng = random.Random(seed)
    ps = []
    for i in range(sims):
        levels = [rng.uniform(0.3, 0.7) for _ in range(strata)]
        xs = [[rng.gauss(m + delta, sd) for _ in range(n)] for m in levels]
        ys = [[rng.gauss(m, sd) for _ in range(n)] for m in levels]
        ps.append(stratified_permutation(xs, ys, draws=draws, seed=seed * sims + i)[1])
    return [sum(p <= alpha for p in ps) / sims for alpha in alphas]


def textworld(sds: list[float], runs: list[int], deltas: list[float]) -> None:
    for horizon, path in PILOTS.items():
        if not path.exists():
            continue
        s = pilot_spread(path)
        print(f"pilot, {horizon} horizon: " + "; ".join(
            f"{arm} {', '.join(f'{v:.3f}' for v in values)}"
            for arm, values in s["runs"].items()) + f"; pooled sd {s['sd']:.4f} ({s['df']} df)")
    print("\nStratified permutation test, 4 warm starts, a normal model of final success "
          "(400 simulated studies, 400 relabellings each): power at alpha 0.05 / at the Holm "
          "worst case 0.05/8")
    print_power_table(sds, runs, deltas, 4)


def print_power_table(sds: list[float], runs: list[int], deltas: list[float],
                      strata: int) -> None:
    """The normal model's power per sd, runs per arm and warm start, and gap, at alpha 0.05
    and at the Holm worst case 0.05/8, as a markdown table (studies 3 and 4)."""
    alphas = [0.05, 0.05 / 8]
    print("| sd | runs per arm and warm start | " + " | ".join(f"gap {d:+.2f}" for d in deltas)
          + " |")
    print("|---:|---:|" + "---|" * len(deltas))
    for sd in sds:
        for n in runs:
            cells = [normal_power(sd, d, strata, n, alphas) for d in deltas]
            print(f"| {sd:.3f} | {n} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in cells)
                  + " |")


# --- study 4 (wiki_search, two horizons; the pilot of issue 76) --------------------------------

WIKI_PILOT = Path(__file__).resolve().parent / "results" / "wiki-search-pilot"


def wiki(sds: list[float], runs: list[int], deltas: list[float], strata: int) -> None:
    """The wiki pilot's final held-out exact match per run and horizon (its report, from
    ``wiki_search_pilot.py --report``), then the same normal model's power as study 3's
    with ``strata`` warm starts."""
    report = json.loads((WIKI_PILOT / "report.json").read_text())
    for horizon in ("one_hop", "two_hop"):
        rows = report.get(horizon, {}).get("runs", {})
        finals = {name: row["after"]["exact_match"] for name, row in rows.items()
                  if "after" in row}
        sd = statistics.stdev(finals.values()) if len(finals) >= 2 else float("nan")
        print(f"pilot, {horizon}: final exact match " + ", ".join(
            f"{name} {v:.3f}" for name, v in finals.items()) + f"; sd {sd:.4f} "
            f"({max(len(finals) - 1, 0)} df)")
    second = report.get("second_pilot")
    for arm, values in (second or {}).get("arms", {}).items():
        print(f"second pilot, one_hop, {arm}: " + "; ".join(
            f"final {metric} " + ", ".join(f"{v:.3f}" for v in values[metric]["values"])
            + (f", sd {values[metric]['sd']:.4f} ({values[metric]['df']} df)"
               if values[metric]["sd"] is not None else "") for metric in ("exact_match",
                                                                        "tool_success")))
    for metric, pooled in (second or {}).get("pooled_sd", {}).items():
        print(f"second pilot: pooled sd of final {metric} {pooled['sd']:.4f} "
              f"({pooled['df']} df)")
    print(f"\nStratified permutation test, {strata} warm start(s), a normal model of the final "
          "metric (400 simulated studies, 400 relabellings each): power at alpha 0.05 / at "
          "the Holm worst case 0.05/8")
    print_power_table(sds, runs, deltas, strata)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stress", action="store_true",
                        help="the stress study's power, from the confirmatory study's runs")
    parser.add_argument("--textworld", action="store_true",
                        help="study 3's power, from its pilot's spread")
    parser.add_argument("--wiki", action="store_true",
                        help="study 4's power, from the wiki_search pilot's spread")
    parser.add_argument("--strata", type=int, default=2,
                        help="--wiki: warm starts (strata of the permutation test)")
    parser.add_argument("--sd", type=float, nargs="+", default=[0.03, 0.05, 0.07])
    parser.add_argument("--runs", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.04, 0.06, 0.08])
    args = parser.parse_args()
    if args.wiki:
        wiki(args.sd, args.runs, args.gaps, args.strata)
    elif args.textworld:
        textworld(args.sd, args.runs, args.gaps)
    else:
        stress() if args.stress else main()
