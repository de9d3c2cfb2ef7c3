"""The stress study's registered analysis, recomputed independently, and compared with the
report ``stress.py --report`` wrote (docs/study-stress.md, "Running it").

Nothing of the project's is imported: this reads the kept cells (each ``summary.json``
and ``trainer/metrics.jsonl``, ``tuning-choice.json``, the manifest) and the report, and
recomputes every number in the report with numpy, scipy and statsmodels, in their own
venv (the project's venv has neither, and the study's runs record that venv's packages):

    python3 -m venv /tmp/statcheck && /tmp/statcheck/bin/pip install numpy scipy statsmodels
    /tmp/statcheck/bin/python experiments/stress_check.py --report runs/stress.md

What it recomputes, and how:
- the grid: every registered cell finished, or failed 3 times; each finished cell's
  finished attempt ran at its rate (tuning: its folder's; confirmation: the chosen one),
  from the kept warm start (sha256), its seed in its warm start's seed range;
- the learning-rate rule, from the tuning runs (and that ``tuning-choice.json`` holds it);
- the primary and secondary tests: the stratified permutation p **exactly**, by
  convolving each warm start's distribution of the statistic over all its relabellings
  (the values are fractions of 128 items, or 0/1, so sums are integers), where the runner
  drew 100,000 relabellings: the two agree within the Monte Carlo error; Holm by
  statsmodels' ``multipletests``; Wilson intervals by its ``proportion_confint``;
- TOST from the registration's formulas, with scipy's Student's t; t-intervals with scipy's
  quantiles (the runner's table rounds the degrees of freedom down: a little wider);
- the stalled-run tables and the sensitivity line (deviation 1), the per-warm-start
  means, the warm starts' starting policies, and every run's five values.

Prints each comparison that fails, a summary line, and exits 1 when any number differs
by more than its rounding (or, for a permutation p, its Monte Carlo error) allows.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results" / "stress"
ENV = "arithmetic_tool"
# the registration's design (docs/study-stress.md)
ARMS = {"grpo": "GRPO-OR (outcome only)", "mt_grpo": "MT-GRPO",
        "gigpo": "GiGPO (outcome only)", "turn_rtg": "turn-RTG"}
BASELINE = "grpo"
LRS = (1e-4, 3e-4, 1e-3)
TUNING_SEEDS = (100, 101, 102, 103)
WARM_STARTS = (1, 2, 3, 4)
RUNS_PER_WARM_START = 8
COLLAPSE_BELOW = 0.5
MARGIN = 0.08
DRAWS = 100_000
MAX_ATTEMPTS = 3
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def seeds_of(ws: int) -> list[int]:
    return [200 + 8 * (ws - 1) + i for i in range(RUNS_PER_WARM_START)]


# --- reading the kept cells -------------------------------------------------------------------

def run_values(folder: Path) -> dict[str, Any]:
    summary = json.loads((folder / "summary.json").read_text())
    after = summary["after"][ENV]
    values = {k: float(after.get(k, 0.0))
              for k in ("tool_success", "correct", "direct_answer", "exact_match")}
    curve = [m["env/correct"] for m in map(json.loads, (folder / "trainer" / "metrics.jsonl")
                                             .read_text().splitlines()) if "env/correct" in m]
    values["auc"] = sum(curve) / len(curve) if curve else 0.0
    values["stalled"] = summary.get("stopped_early")
    values["before"] = summary.get("before", {}).get(ENV)
    return values


def read_runs(results: Path) -> dict[str, dict[tuple, dict]]:
    """stage -> (arm, lr or ws, seed) -> values, from the folders (not the runner's grid)."""
    runs: dict[str, dict[tuple, dict]] = {"tuning": {}, "confirmation": {}}
    for stage, prefix, parse in (("tuning", "lr", float), ("confirmation", "ws", int)):
        for path in sorted(results.glob(f"{stage}/{prefix}*/*-seed*/summary.json")):
            arm, seed = path.parent.name.rsplit("-seed", 1)
            where = parse(path.parent.parent.name[len(prefix):])
            runs[stage][(arm, where, int(seed))] = run_values(path.parent)
    return runs


# --- the statistics, independently ---------------------------------------------------------

def integer_scale(values: list[float]) -> int | None:
    """The smallest integer that makes every value an integer (denominators up to 1000),
    or None."""
    scale = 1
    for v in values:
        f = Fraction(v).limit_denominator(1000)
        if abs(float(f) - v) > 1e-9:
            return None
        scale = math.lcm(scale, f.denominator)
    return scale


def exact_stratified_p(x: list[list[float]], y: list[list[float]]) -> tuple[float, float]:
    """The statistic (mean over strata of mean(x) - mean(y)) and its exact two-sided
    permutation p over every relabelling within every stratum: each stratum's statistic,
    times an integer, is an integer function of the sum S of the values labelled x, whose
    distribution over all C(n, k) labellings a subset-sum count gives; the strata's
    distributions are convolved."""
    scale = integer_scale([v for s in x + y for v in s])
    if scale is None:
        raise ValueError("values are not fractions with small denominators")
    unit = math.lcm(*(len(a) * len(b) for a, b in zip(x, y)))
    total_dist: dict[int, int] = {0: 1}
    observed = 0
    for a, b in zip(x, y):
        ints = [round(v * scale) for v in a + b]
        k, n, total = len(a), len(a) + len(b), sum(ints)
        factor = unit // (len(a) * len(b))

        def value(s: int) -> int:  # (S/k - (T-S)/(n-k)) * k(n-k) = S*n - T*k
            return (s * n - total * k) * factor

        observed += value(round(sum(a) * scale))
        counts = [dict() for _ in range(k + 1)]  # size -> sum -> number of subsets
        counts[0][0] = 1
        for v in ints:
            for size in range(k - 1, -1, -1):
                for s, c in counts[size].items():
                    counts[size + 1][s + v] = counts[size + 1].get(s + v, 0) + c
        stratum: dict[int, int] = {}
        for s, c in counts[k].items():
            stratum[value(s)] = stratum.get(value(s), 0) + c
        merged: dict[int, int] = {}
        for t, c in total_dist.items():
            for u, d in stratum.items():
                merged[t + u] = merged.get(t + u, 0) + c * d
        total_dist = merged
    everything = sum(total_dist.values())
    hits = sum(c for t, c in total_dist.items() if abs(t) >= abs(observed))
    return observed / (unit * scale * len(x)), hits / everything


def stratified(values: dict, arm: str, other: str, key: str, min_runs: int = 1):
    shared = sorted(ws for ws in set(values.get(arm, {})) & set(values.get(other, {}))
                    if min(len(values[arm][ws]), len(values[other][ws])) >= min_runs)

    def pick(r: dict) -> float:
        return float(r["tool_success"] < COLLAPSE_BELOW) if key == "collapsed" else r[key]

    return ([[pick(r) for r in values[arm][ws]] for ws in shared],
            [[pick(r) for r in values[other][ws]] for ws in shared])


def holm(p: dict[str, float]) -> dict[str, float]:
    if not p:
        return {}
    names = list(p)
    return dict(zip(names, multipletests([p[n] for n in names], method="holm")[1]))


def tost(x: list[list[float]], y: list[list[float]]) -> dict[str, float]:
    """docs/study-stress.md: D = mean over the K strata of the within-stratum difference,
    Var(D) = Σ_k (s²_a,k/n_a,k + s²_b,k/n_b,k) / K², Welch-Satterthwaite df,
    p = max(P(T > (D + m)/se), P(T > (m - D)/se)); the 90 % interval D ± t_0.95 · se."""
    K = len(x)
    d = float(np.mean([np.mean(a) - np.mean(b) for a, b in zip(x, y)]))
    terms = [(np.var(v, ddof=1) / len(v) / K**2, len(v)) for a, b in zip(x, y) for v in (a, b)]
    var = sum(t for t, _ in terms)
    if var == 0:
        return {"difference": d, "low": d, "high": d, "df": math.inf,
                "p": 0.0 if abs(d) < MARGIN else 1.0}
    df = var**2 / sum(t**2 / (n - 1) for t, n in terms)
    se = math.sqrt(var)
    p = max(stats.t.sf((d + MARGIN) / se, df), stats.t.sf((MARGIN - d) / se, df))
    half = stats.t.ppf(0.95, df) * se
    return {"difference": d, "low": d - half, "high": d + half, "df": df, "p": float(p)}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, mean, mean
    half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def tests(values: dict) -> dict:
    others = [a for a in ARMS if a != BASELINE and a in values]
    out: dict = {}
    for name, key in (("accuracy", "correct"), ("collapse", "collapsed")):
        rows = {a: exact_stratified_p(*stratified(values, a, BASELINE, key)) for a in others
                if BASELINE in values}
        out[name] = {"difference": {a: r[0] for a, r in rows.items()},
                     "p": {a: r[1] for a, r in rows.items()},
                     "holm": holm({a: r[1] for a, r in rows.items()})}
    families = {"against GRPO-OR": [(a, BASELINE) for a in others if BASELINE in values],
                "between the other arms": [(a, b) for i, a in enumerate(others)
                                           for b in others[i + 1:]]}
    for family, pairs in families.items():
        rows = {f"{a} - {b}": tost(*stratified(values, a, b, "correct", min_runs=2))
                for a, b in pairs}
        adjusted = holm({k: r["p"] for k, r in rows.items()})
        out[family] = {k: {**r, "holm": adjusted[k]} for k, r in rows.items()}
    return out


# --- the comparison ------------------------------------------------------------------------

class Checker:
    def __init__(self) -> None:
        self.checked = 0
        self.failed: list[str] = []

    def near(self, what: str, mine: float, theirs: float, tolerance: float) -> None:
        self.checked += 1
        if not abs(mine - theirs) <= tolerance + 1e-12:
            self.failed.append(f"{what}: recomputed {mine:.6g}, report {theirs:.6g} "
                               f"(tolerance {tolerance:.2g})")

    def same(self, what: str, expected: object, found: object) -> None:
        """``expected``: recomputed here (or what the registration says); ``found``: in
        the report or the kept files."""
        self.checked += 1
        if expected != found:
            self.failed.append(f"{what}: {expected!r} expected, {found!r} found")

    def p(self, what: str, exact: float, reported: str, times: int = 1) -> None:
        """A Monte Carlo p (100,000 draws, counting the observed one) against the exact p:
        within 4.5 standard errors (times the Holm factor for an adjusted one), plus the
        printed rounding."""
        value = float(reported)
        sd = math.sqrt(max(exact * (1 - exact), 1e-12) / DRAWS)
        self.near(what, exact, value, times * (4.5 * sd + 1 / DRAWS) + printed(reported))


def printed(text: str) -> float:
    """Half a unit in the last printed place."""
    text = text.strip().lstrip("+-")
    if "e" in text:
        mantissa, exponent = text.split("e")
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return 0.5 * 10 ** (int(exponent) - decimals)
    return 0.5 * 10 ** -(len(text.split(".")[1]) if "." in text else 0)


def table(lines: list[str], starts: str) -> list[list[str]]:
    """The rows (cells, stripped) of the first markdown table after the line that starts
    with ``starts``."""
    at = next((i for i, line in enumerate(lines) if line.startswith(starts)), None)
    if at is None:
        raise SystemExit(f"the report has no line starting with {starts!r}: is it the "
                         "output of `stress.py --report` for the whole grid?")
    rows, seen = [], False
    for line in lines[at + 1:]:
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set(cells[0]) <= set("-:"):
                rows.append(cells)
        elif seen:
            break
    return rows[1:]  # without the header


def numbers(cell: str) -> list[str]:
    return NUMBER.findall(cell.replace("**", ""))


def check(results: Path, report: str) -> tuple[Checker, dict]:
    """The comparisons, and the registered tests as recomputed here (p exact)."""
    c = Checker()
    lines = report.splitlines()
    runs = read_runs(results)
    manifest = [json.loads(line) for line in (results / "manifest.jsonl").read_text().splitlines()
                if line.strip()]
    choice = {a: float(lr) for a, lr in
              json.loads((results / "tuning-choice.json").read_text())["chosen"].items()}
    label = {v: k for k, v in ARMS.items()}

    # the grid, and what each finished cell ran with
    sha = {ws: json.loads((results / f"warm-starts/ws{ws}/summary.json").read_text())["sha256"]
           for ws in (0, *WARM_STARTS)}
    expected = ([("tuning", (a, lr, s), f"tuning/lr{lr:g}/{a}-seed{s}")
                 for a in ARMS for lr in LRS for s in TUNING_SEEDS]
                + [("confirmation", (a, ws, s), f"confirmation/ws{ws}/{a}-seed{s}")
                   for a in ARMS for ws in WARM_STARTS for s in seeds_of(ws)])
    grid = {(stage, key) for stage, key, _ in expected}
    unexpected = [k for stage in runs for k in runs[stage] if (stage, k) not in grid]
    c.same("finished cells outside the registered grid", unexpected, [])
    for stage, key, cell in expected:
        attempts = [e for e in manifest if e["cell"] == cell]
        if key not in runs[stage]:
            failed = sum(e["outcome"] == "failed" for e in attempts)
            c.same(f"{cell}: missing, failed attempts", min(failed, MAX_ATTEMPTS), MAX_ATTEMPTS)
            continue
        done = [e for e in attempts if e["outcome"] == "finished"]
        c.same(f"{cell}: finished attempts", len(done), 1)
        if not done:
            continue
        e = done[0]
        lr = key[1] if stage == "tuning" else choice[key[0]]
        ws = 0 if stage == "tuning" else key[1]
        c.same(f"{cell}: learning rate run", lr, float(e["config"]["train"]["lr"]))
        c.same(f"{cell}: warm start sha256", sha[ws], e["warm_start_sha256"])
        c.same(f"{cell}: clean tree", False, e["dirty"])

    # the rule
    for arm in ARMS:
        means = {lr: statistics.mean(v["correct"] for (a, l, _), v in runs["tuning"].items()
                                     if a == arm and l == lr)
                 for lr in LRS if any(a == arm and l == lr for a, l, _ in runs["tuning"])}
        best = max(means.values()) if means else None
        mine = min(lr for lr, m in means.items() if m >= best - 1e-12) if means else 3e-4
        c.same(f"the rule's rate for {arm}", mine, choice[arm])

    # warm starts: sha256 and the first run's before-RL values
    for row in table(lines, "Warm starts"):
        ws = int(row[0][2:])
        c.same(f"ws{ws} sha256", sha[ws][:12], row[2].strip("`…"))
        befores = [v["before"] for key, v in runs["tuning" if ws == 0 else "confirmation"]
                   .items() if v["before"] and (ws == 0 or key[1] == ws)]
        c.same(f"ws{ws}: runs that evaluated the starting policy", len(befores),
               0 if row[3] == "" else 1)
        if len(befores) == 1:
            for key, text in zip(("tool_success", "correct", "direct_answer"), row[3:6]):
                c.near(f"ws{ws} before RL {key}", befores[0].get(key, 0.0), float(text),
                       printed(text))

    # tuning table
    for row in table(lines, "Tuning (warm start ws0)"):
        arm = label[row[0]]
        for lr, text in zip(LRS, row[1:]):
            vals = [v for (a, l, _), v in runs["tuning"].items() if a == arm and l == lr]
            if not vals:
                c.same(f"tuning {arm} lr {lr:g}", "no run", text)
                continue
            mean, lo, hi, n, collapsed = numbers(text)
            m, low, high = t_interval([v["correct"] for v in vals])
            c.near(f"tuning {arm} lr {lr:g} mean", m, float(mean), printed(mean))
            c.near(f"tuning {arm} lr {lr:g} interval low", low, float(lo), printed(lo) + 2e-3)
            c.near(f"tuning {arm} lr {lr:g} interval high", high, float(hi), printed(hi) + 2e-3)
            c.same(f"tuning {arm} lr {lr:g} runs", len(vals), int(n))
            c.same(f"tuning {arm} lr {lr:g} collapsed",
                   sum(v["tool_success"] < COLLAPSE_BELOW for v in vals), int(collapsed))
            c.same(f"tuning {arm} lr {lr:g} chosen (bold)", choice[arm] == lr, "**" in text)

    # stalled runs (deviation 1)
    for header, stage, columns in (("Tuning runs that stalled", "tuning", LRS),
                                   ("Confirmation runs that stalled", "confirmation",
                                    WARM_STARTS)):
        for row in table(lines, header):
            arm = label[row[0]]
            for column, text in zip([*columns, None], row[1:]):
                vals = [v for (a, col, _), v in runs[stage].items()
                        if a == arm and (column is None or col == column)]
                c.same(f"{header.lower()}: {arm} {column}",
                       f"{sum(v['stalled'] is not None for v in vals)} of {len(vals)}", text)

    # the registered tests
    values: dict = {}
    for (arm, ws, _), v in runs["confirmation"].items():
        values.setdefault(arm, {}).setdefault(ws, []).append(v)
    mine = tests(values)
    for row in table(lines, "Confirmation:"):
        arm = label[row[0]]
        vals = [v for ws in sorted(values[arm]) for v in values[arm][ws]]
        c.same(f"confirmation {arm} lr", choice[arm], float(row[1]))
        c.same(f"confirmation {arm} runs", len(vals), int(row[2]))
        m, low, high = t_interval([v["correct"] for v in vals])
        mean, lo, hi = numbers(row[3])
        c.near(f"confirmation {arm} mean", m, float(mean), printed(mean))
        c.near(f"confirmation {arm} interval low", low, float(lo), printed(lo) + 1e-3)
        c.near(f"confirmation {arm} interval high", high, float(hi), printed(hi) + 1e-3)
        count = sum(v["tool_success"] < COLLAPSE_BELOW for v in vals)
        rate, rlow, rhigh = (count / len(vals),
                             *proportion_confint(count, len(vals), method="wilson"))
        n_c, r_c, lo_c, hi_c = numbers(row[6])
        c.same(f"confirmation {arm} collapsed", count, int(n_c))
        for what, x, text in (("rate", rate, r_c), ("Wilson low", rlow, lo_c),
                              ("Wilson high", rhigh, hi_c)):
            c.near(f"confirmation {arm} collapse {what}", x, float(text), printed(text))
        if arm == BASELINE:
            continue
        for name, diff_cell, p_cell in (("accuracy", row[4], row[5]),
                                        ("collapse", row[7], row[8])):
            diff = numbers(diff_cell)[0]
            p, adjusted = numbers(p_cell)
            c.near(f"{name} {arm} difference", mine[name]["difference"][arm], float(diff),
                   printed(diff))
            c.p(f"{name} {arm} p (exact {mine[name]['p'][arm]:.3g})", mine[name]["p"][arm], p)
            c.p(f"{name} {arm} Holm p", mine[name]["holm"][arm], adjusted, times=3)
            c.same(f"{name} {arm}: significant at 0.05 (exact Holm p against the report's)",
                   bool(mine[name]["holm"][arm] <= 0.05), float(adjusted) <= 0.05)

    # the sensitivity line (not registered): the primary test without stalled runs
    line = next((x for x in lines if x.startswith("Sensitivity")), "")
    kept = {a: {ws: [v for v in rs if v["stalled"] is None] for ws, rs in per.items()}
            for a, per in values.items()}
    kept = {a: {ws: rs for ws, rs in per.items() if rs} for a, per in kept.items()}
    kept = {a: per for a, per in kept.items() if per}
    left_out = sum(len(r) for per in values.values() for r in per.values()) - sum(
        len(r) for per in kept.values() for r in per.values())
    if not left_out:
        c.same("sensitivity line", line.startswith("Sensitivity: no confirmation run stalled"),
               True)
    elif BASELINE in kept:
        again = tests(kept)["accuracy"]
        c.same("sensitivity: runs left out", f"without the {left_out} stalled" in line, True)
        for arm in again["p"]:
            found = re.search(re.escape(ARMS[arm]) + r" ([-+]\d\.\d+), p (\S+) \(Holm (\S+)\)",
                              line)
            c.same(f"sensitivity {arm} in the line", found is not None, True)
            if found:
                c.near(f"sensitivity {arm} difference", again["difference"][arm],
                       float(found[1]), printed(found[1]))
                c.p(f"sensitivity {arm} p", again["p"][arm], found[2])
                c.p(f"sensitivity {arm} Holm p", again["holm"][arm], found[3], times=3)

    # TOST
    for row in table(lines, "Equivalence (TOST"):
        r = mine[row[0]][row[1]]
        d, lo, hi = numbers(row[2])
        for what, x, text in (("difference", r["difference"], d), ("low", r["low"], lo),
                              ("high", r["high"], hi), ("df", r["df"], row[3]),
                              ("p", r["p"], row[4]), ("Holm p", r["holm"], row[5])):
            c.near(f"TOST {row[1]} {what}", x, float(text), printed(text) + abs(x) * 1e-6)

    # per warm start, and every run
    for row in table(lines, "Per warm start"):
        arm = label[row[0]]
        for ws, text in zip(WARM_STARTS, row[1:]):
            if text == "—":
                c.same(f"per warm start {arm} ws{ws}", ws in values.get(arm, {}), False)
                continue
            mean, n = numbers(text)
            c.near(f"per warm start {arm} ws{ws}",
                   statistics.mean(v["correct"] for v in values[arm][ws]), float(mean),
                   printed(mean))
            c.same(f"per warm start {arm} ws{ws} runs", len(values[arm][ws]), int(n))
    listed = 0
    for row in table(lines, "Every run"):
        stage, where, name = row[0].split("/")
        arm, seed = name.rsplit("-seed", 1)
        key = (arm, float(where[2:]) if stage == "tuning" else int(where[2:]), int(seed))
        if row[1].startswith("missing"):
            c.same(f"{row[0]} missing", key in runs[stage], False)
            continue
        listed += 1
        for what, text in zip(("tool_success", "correct", "direct_answer", "exact_match", "auc"),
                              row[1].split(" / ")):
            c.near(f"{row[0]} {what}", runs[stage][key][what], float(text), printed(text))
    c.same("runs in the every-run table", listed, len(runs["tuning"]) + len(runs["confirmation"]))
    return c, mine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report", type=Path, required=True,
                        help="the markdown `stress.py --report` wrote (its --out)")
    args = parser.parse_args()
    c, exact = check(args.results, args.report.read_text())
    for name in ("accuracy", "collapse"):
        print(f"exact permutation p, {name} against {BASELINE}: " + "; ".join(
            f"{arm} {exact[name]['difference'][arm]:+.3f}, p {p:.3g} (Holm "
            f"{exact[name]['holm'][arm]:.3g})" for arm, p in exact[name]["p"].items()))
    for line in c.failed:
        print("DIFFERS:", line)
    print(f"stress check: {c.checked - len(c.failed)} of {c.checked} numbers and facts in "
          f"{args.report} recomputed independently agree"
          + ("" if not c.failed else f"; {len(c.failed)} differ"))
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
