"""Study 3's registered analysis (docs/study-textworld-credit.md), recomputed independently,
and compared with the report ``textworld_credit.py --report`` wrote.

Nothing of the project's is imported but ``stress_check.py``'s independent pieces (the
exact permutation p, Holm, reading the report's tables; it imports nothing of the
project's either): this reads the kept cells (each ``summary.json`` and
``trainer/metrics.jsonl``, the warm starts' weights and summaries, ``tuning-choice.json``,
``manifest.jsonl``) and the report, and recomputes every number in the report with numpy,
scipy and statsmodels, in their own venv (the project's venv has no scipy, and the study's
runs record that venv's packages). Written from the registration before the analysis
point, and tested on synthetic runs only (tests/test_textworld_credit.py):

    python3 -m venv /tmp/statcheck && /tmp/statcheck/bin/pip install numpy scipy statsmodels
    /tmp/statcheck/bin/python experiments/textworld_credit_check.py \
        --report runs/textworld-credit.md

What it recomputes, and how:
- the grid: every registered cell finished once, or failed 3 times, and none else; the
  cells in the registered order; each finished run's recorded config at its rate (tuning:
  its folder's; confirmation: the chosen one), estimator, seeds (trainer's, games' 1000 +
  seed), 40 steps, 256 final games, the registered sampling; from the warm start the
  registration picks, whose kept weights hash (sha256, recomputed here) to the recorded
  hash the manifest names; one commit (the registration's), a clean tree;
- the warm starts: candidates 1, 2, ... in order, each made or failed 3 times, the first 4
  inside the horizon's band, none made after; their seeds; their evaluation's Wilson
  interval; the tuning warm start (short, candidate 0);
- the learning-rate rule from the tuning runs, against ``tuning-choice.json`` (its choice,
  its table, written after the last tuning attempt began and before the next stage);
- the tables: means, t-intervals with scipy's quantiles (the runner's table rounds the
  degrees of freedom down: a little wider, never narrower), per-warm-start means,
  collapse counts with statsmodels' Wilson ``proportion_confint``;
- the tests: the stratified permutation p **exactly** (stress_check's: each warm start's
  distribution of the statistic over all its relabellings, convolved; success is a
  fraction of the games, collapse 0/1, so sums are integers at a common scale); where the
  runner drew 100,000 relabellings (more than 100,000 in all) the two agree within the
  Monte Carlo error, elsewhere within the printed rounding; Holm by statsmodels'
  ``multipletests`` (on the Monte Carlo bounds too: Holm is monotone); TOST and the
  interaction's Welch test from the registration's formulas with scipy's Student's t;
- every run's final success, and the progress line's counts.

Prints each difference (``DIFFERS:``), notes (``NOTE:``) where the registration reads two
ways, a summary line, and exits 1 when any number differs by more than its rounding (or,
for a Monte Carlo p, its Monte Carlo error) allows.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats
from statsmodels.stats.proportion import proportion_confint

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))

import stress_check as sc  # noqa: E402  (the stress study's check: imports nothing either)

RESULTS = REPO / "experiments" / "results" / "textworld-credit"
ENV = "textworld_cooking"
# the registration's design (docs/study-textworld-credit.md); the labels are the report's
ARMS = {"grpo": "GRPO-OR (outcome)", "grpo_merged": "GRPO-MR (summed turn rewards)",
        "mt_grpo": "MT-GRPO", "mt_grpo_unbiased": "MT-GRPO, unbiased baseline",
        "turn_rtg": "turn-RTG", "gigpo": "GiGPO"}
BASELINES = ("grpo", "grpo_merged")
CREDIT_ARMS = ("mt_grpo", "mt_grpo_unbiased", "turn_rtg", "gigpo")
HORIZONS = ("short", "long")
LRS = (1e-4, 3e-4, 1e-3)
TUNING_SEED = 300
FALLBACK_LR = 3e-4
BANDS = {"short": (Fraction("0.25"), Fraction("0.55")),
         "long": (Fraction("0.08"), Fraction("0.30"))}
DEMONSTRATOR_BANDS = {"short": [0.55, 0.8], "long": [0.85, 0.95]}
WARM_STARTS = 4
MAX_CANDIDATES = 8
RUNS = {"short": 2, "long": 3}
SEED_BASE = {"short": 400, "long": 500}
STEPS = 40
EVAL_GAMES = 256
COLLAPSE_DROP = Fraction("0.10")
MARGIN = 0.05
ALPHA = 0.05
DRAWS = 100_000
MAX_ATTEMPTS = 3
REGISTRATION_COMMIT = "2d535c5"
FAMILIES = {"primary: long, success": ("long", "success_f"),
            "short, success": ("short", "success_f"),
            "long, collapse": ("long", "collapsed"), "short, collapse": ("short", "collapsed")}


def tuning_ids() -> list[str]:
    return [f"tuning/lr{lr:g}/{arm}-seed{TUNING_SEED}" for lr in LRS for arm in ARMS]


def confirmation_cells(chosen: dict[str, list[int]]) -> list[tuple[str, int, str, int]]:
    """(horizon, ws, arm, seed) in the registered order: run index, horizon, ws, arm."""
    return [(h, ws, arm, SEED_BASE[h] + 10 * (ws - 1) + i) for i in range(max(RUNS.values()))
            for h in HORIZONS if i < RUNS[h] for ws in range(1, len(chosen[h]) + 1)
            for arm in ARMS]


def conf_id(h: str, ws: int, arm: str, seed: int) -> str:
    return f"confirmation/{h}/ws{ws}/{arm}-seed{seed}"


def exact(v: float) -> Fraction:
    """The fraction a value stands for (a share of games: k/256, or a printed decimal)."""
    f = Fraction(v).limit_denominator(10**6)
    return f if abs(float(f) - v) <= 1e-12 else Fraction(v)


def weights_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


# --- the statistics, independently ---------------------------------------------------------

def relabellings(x: list[list], y: list[list]) -> int:
    return math.prod(math.comb(len(a) + len(b), len(a)) for a, b in zip(x, y))


def p_bounds(p: float, count: int) -> tuple[float, float]:
    """Where the runner's p must lie: exact (at most DRAWS relabellings), else its Monte
    Carlo p, (1 + hits) / (1 + DRAWS), within 4.5 standard errors of its expectation."""
    if count <= DRAWS:
        return p, p
    expected = (1 + DRAWS * p) / (1 + DRAWS)
    sd = math.sqrt(p * (1 - p) / DRAWS)
    return max(1 / (1 + DRAWS), expected - 4.5 * sd), min(1.0, expected + 4.5 * sd)


def with_holm(tests: dict[str, dict]) -> dict[str, dict]:
    for key, source in (("holm", "p"), ("holm_low", "p_low"), ("holm_high", "p_high")):
        for name, value in sc.holm({k: t[source] for k, t in tests.items()}).items():
            tests[name][key] = float(value)
    return tests


def strata(values: dict, arm: str, other: str, key: str) -> tuple[list, list]:
    shared = sorted(set(values.get(arm, {})) & set(values.get(other, {})))
    return ([[r[key] for r in values[arm][ws]] for ws in shared],
            [[r[key] for r in values[other][ws]] for ws in shared])


def variance_terms(x: list[list[float]], y: list[list[float]]) -> tuple[float, list[tuple]]:
    """D = mean over the K strata of the within-stratum difference; the terms of
    Var(D) = Σ_k (s²_a,k/n_a,k + s²_b,k/n_b,k) / K², each with its n."""
    K = len(x)
    d = float(np.mean([np.mean(a) - np.mean(b) for a, b in zip(x, y)]))
    return d, [(float(np.var(v, ddof=1)) / len(v) / K**2, len(v)) for a, b in zip(x, y)
               for v in (a, b)]


def welch_df(terms: list[tuple]) -> float:
    var = sum(t for t, _ in terms)
    return var**2 / sum(t**2 / (n - 1) for t, n in terms) if var else math.inf


def tost(x: list[list[float]], y: list[list[float]]) -> dict[str, float]:
    """p = max(P(T > (D + m)/se), P(T > (m - D)/se)), Welch-Satterthwaite df; the 90 %
    interval D ± t_0.95 · se (equivalent at 0.05 exactly when inside ±m)."""
    d, terms = variance_terms(x, y)
    var = sum(t for t, _ in terms)
    if var == 0:
        p = 0.0 if abs(d) < MARGIN else 1.0
        return {"difference": d, "low": d, "high": d, "p": p, "p_low": p, "p_high": p}
    df, se = welch_df(terms), math.sqrt(var)
    p = float(max(stats.t.sf((d + MARGIN) / se, df), stats.t.sf((MARGIN - d) / se, df)))
    half = float(stats.t.ppf(0.95, df)) * se
    return {"difference": d, "low": d - half, "high": d + half, "p": p, "p_low": p, "p_high": p}


def interaction(long: tuple, short: tuple) -> dict[str, float]:
    """(D long) - (D short) against GRPO-MR; variance the sum of the two, Welch df over
    all the variance terms; two-sided p from Student's t."""
    (d1, t1), (d2, t2) = variance_terms(*long), variance_terms(*short)
    d, terms = d1 - d2, t1 + t2
    var = sum(t for t, _ in terms)
    p = (float(2 * stats.t.sf(abs(d) / math.sqrt(var), welch_df(terms))) if var
         else float(d == 0))
    return {"difference": d, "p": p, "p_low": p, "p_high": p}


def t_interval(values: list[float]) -> tuple[float, float, float, float]:
    """Mean, its 95 % t-interval, and the half-width the runner's printed table of t gives
    (its degrees of freedom rounded down to 1-10, 15, 20, 30, 40 or 60): a little wider."""
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, mean, mean, 0.0
    df = len(values) - 1
    se = float(np.std(values, ddof=1)) / math.sqrt(len(values))
    half = float(stats.t.ppf(0.975, df)) * se
    tabled = max(d for d in (*range(1, 11), 15, 20, 30, 40, 60) if d <= df)
    return mean, mean - half, mean + half, float(stats.t.ppf(0.975, tabled)) * se


def two_each(x: list[list], y: list[list]) -> bool:
    return all(len(v) >= 2 for v in x + y)


def registered_tests(values: dict[str, dict]) -> tuple[dict[str, dict], list[str]]:
    """The families as registered; and notes where the registration reads two ways."""
    out: dict[str, dict] = {}
    notes: list[str] = []
    for family, (h, key) in FAMILIES.items():
        tests = {}
        for arm in CREDIT_ARMS:
            for base in BASELINES:
                x, y = strata(values.get(h, {}), arm, base, key)
                if x:
                    d, p = sc.exact_stratified_p(x, y)
                    count = relabellings(x, y)
                    low, high = p_bounds(p, count)
                    tests[f"{arm} - {base}"] = {"difference": d, "p": p, "p_low": low,
                                                "p_high": high, "relabellings": count}
        out[family] = with_holm(tests)

    def floats(h: str, arm: str, base: str) -> tuple[list, list]:
        return strata(values.get(h, {}), arm, base, "success_f")

    def ambiguous(what: str, parts: list[tuple]) -> None:
        # "TOST and the interaction need 2 runs of each arm in a stratum": read (as the
        # runner does) as no test when a shared warm start has fewer; the other reading
        # leaves that warm start out
        kept = [([a for a, b in zip(x, y) if two_each([a], [b])],
                 [b for a, b in zip(x, y) if two_each([a], [b])]) for x, y in parts]
        if all(x for x, _ in kept):
            value = tost(*kept[0]) if len(kept) == 1 else interaction(*kept)
            notes.append(f"{what}: not made (a shared warm start has fewer than 2 runs of an "
                         "arm); with that warm start left out instead it would be "
                         f"{value['difference']:+.3f}, p {value['p']:.4g} (before Holm)")

    inter = {}
    for arm in CREDIT_ARMS:
        parts = [floats(h, arm, "grpo_merged") for h in ("long", "short")]
        if all(p[0] for p in parts):
            if all(two_each(*p) for p in parts):
                inter[f"{arm} - grpo_merged"] = interaction(*parts)
            else:
                ambiguous(f"interaction, {arm} - grpo_merged", parts)
    out["interaction"] = with_holm(inter)
    for h in ("long", "short"):
        tests = {}
        for arm in CREDIT_ARMS:
            for base in BASELINES:
                x, y = floats(h, arm, base)
                if x and two_each(x, y):
                    tests[f"{arm} - {base}"] = tost(x, y)
                elif x:
                    ambiguous(f"equivalence, {h}, {arm} - {base}", [(x, y)])
        out[f"equivalence, {h}"] = with_holm(tests)
    return out, notes


# --- the comparison ------------------------------------------------------------------------

class Checker(sc.Checker):
    """stress_check's, with notes, and printed numbers checked against what is recomputed
    (give or take their rounding)."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    def verdict(self, report: Path) -> int:
        """Prints the notes, what differs and the count; the exit status."""
        print("\n".join([f"NOTE: {x}" for x in self.notes] + [f"DIFFERS: {x}" for x in self.failed]
                        + [f"textworld credit check: {self.checked - len(self.failed)} of "
                           f"{self.checked} numbers and facts in {report} recomputed "
                           "independently agree" + (f"; {len(self.failed)} differ"
                                                    if self.failed else " (all match)")]))
        return 1 if self.failed else 0

    def agrees(self, what: str, mine: float, text: str) -> None:
        self.within(what, mine, mine, text)

    def within(self, what: str, low: float, high: float, text: str, extra: float = 0.0) -> None:
        """The printed number ``text`` inside [low, high], give or take its rounding."""
        self.checked += 1
        slack = sc.printed(text) + extra + 1e-12
        if not low - slack <= float(text) <= high + slack:
            span = f"{low:.6g}" if low == high else f"[{low:.6g}, {high:.6g}]"
            self.failed.append(f"{what}: recomputed {span}, report {text}")


def table(lines: list[str], starts: str, required: bool = True) -> list[list[str]]:
    """stress_check's: the rows of the first markdown table after the line that starts
    with ``starts``, without its header."""
    if not any(line.startswith(starts) for line in lines):
        if required:
            raise SystemExit(f"the report has no line starting with {starts!r}: is it the "
                             "output of `textworld_credit.py --report`?")
        return []
    return sc.table(lines, starts)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def run_of(folder: Path) -> dict[str, Any] | None:
    summary = read_json(folder / "summary.json")
    if summary is None:
        return None
    after = summary["after"][ENV]
    metrics = folder / "trainer" / "metrics.jsonl"
    steps = ([json.loads(line).get("step") for line in metrics.read_text().splitlines()
              if line.strip()] if metrics.exists() else [])
    return {"success_f": float(after["success"]), "success": exact(float(after["success"])),
            "items": after.get("items"), "failed": after.get("failed"),
            "stopped_early": summary.get("stopped_early"), "steps": steps}


def check_run(c: Checker, cell: str, run: dict) -> None:
    steps = run["steps"]
    last = len(steps)
    c.same(f"{cell}: metrics.jsonl steps 1..N", list(range(1, last + 1)), steps)
    c.same(f"{cell}: 40 steps, or stopped early (max_batch_wait_s)",
           True, last == STEPS or (0 < last < STEPS and bool(run["stopped_early"])))
    if run["items"] is not None:
        c.same(f"{cell}: final evaluation games", EVAL_GAMES, run["items"])
        if run["failed"]:
            c.notes.append(f"{cell}: {run['failed']} of its final evaluation's games failed")


def check_attempt(c: Checker, e: dict, cell: str, h: str, arm: str, seed: int, lr: float,
                  ws_cell: str, ws_sha: str | None) -> None:
    train = e["config"]["train"]
    env = e["config"]["envs"][0]["settings"]
    for what, expected, found in (
            ("rate", lr, float(train["lr"])), ("manifest rate", lr, float(e["lr"])),
            ("estimator", arm, train["estimator"]), ("trainer seed", seed, train["seed"]),
            ("games' seed", 1000 + seed, env["seed"]), ("horizon", h, env["horizon"]),
            ("steps", STEPS, train["steps"]), ("final games", EVAL_GAMES, env["eval_items"]),
            ("batch (8 groups of 8)", (64, 8), (train["batch_size"], env["group_size"])),
            ("temperatures", (1.0, 1.0), (env["temperature"], env["eval_temperature"])),
            ("warm-up steps", 10, train["warmup_steps"]),
            ("max_staleness", 2, e["config"]["api"]["max_staleness"]),
            ("max_batch_wait_s", 900, train["max_batch_wait_s"]),
            ("warm start", ws_cell, e.get("warm_start_cell"))):
        c.same(f"{cell}: {what}", expected, found)
    if e.get("warm_start_sha256") is not None:
        c.same(f"{cell}: warm start sha256 (the kept weights')", ws_sha, e["warm_start_sha256"])


def check(results: Path, report: str) -> tuple[Checker, dict]:
    c = Checker()
    lines = report.splitlines()
    manifest = [json.loads(x) for x in (results / "manifest.jsonl").read_text().splitlines()
                if x.strip()]
    attempts: dict[str, list[dict]] = {}
    for e in manifest:
        attempts.setdefault(e["cell"], []).append(e)

    def failed_out(cell: str) -> bool:
        return sum(e["outcome"] == "failed" for e in attempts.get(cell, [])) >= MAX_ATTEMPTS

    def finished_attempt(cell: str) -> dict | None:
        done = [e for e in attempts.get(cell, []) if e["outcome"] == "finished"]
        c.same(f"{cell}: finished attempts in the manifest", 1, len(done))
        return done[0] if done else None

    # warm starts: candidate 0 for tuning; 1, 2, ... in order until 4 are in the band
    ws: dict[tuple[str, int], dict] = {}
    for h in HORIZONS:
        for k in range(0, MAX_CANDIDATES + 1):
            s = read_json(results / f"warm-starts/{h}/seed{k}/summary.json")
            if s is not None:
                ws[h, k] = s
    chosen: dict[str, list[int]] = {}
    expected_ws = ["warm-starts/short/seed0"]
    for h in HORIZONS:
        chosen[h] = []
        for k in range(1, MAX_CANDIDATES + 1):
            if len(chosen[h]) == WARM_STARTS:
                c.same(f"warm-starts/{h}/seed{k}: made though 4 were in the band already",
                       False, (h, k) in ws)
                continue
            expected_ws.append(f"warm-starts/{h}/seed{k}")
            if (h, k) not in ws:
                c.same(f"warm-starts/{h}/seed{k}: neither made nor failed 3 times", True,
                       failed_out(f"warm-starts/{h}/seed{k}"))
                continue
            lo, hi = BANDS[h]
            if lo <= exact(float(ws[h, k]["evaluation"]["success"])) <= hi:
                chosen[h].append(k)
    c.same("the tuning warm start (short, candidate 0) made", True, ("short", 0) in ws)
    c.same("a long candidate 0 among the kept warm starts", False, ("long", 0) in ws)
    for (h, k), s in ws.items():
        cell = f"warm-starts/{h}/seed{k}"
        e = s["evaluation"]
        success = exact(float(e["success"]))
        c.same(f"{cell}: in_band recorded", BANDS[h][0] <= success <= BANDS[h][1], s.get("in_band"))
        c.same(f"{cell}: band recorded", [float(b) for b in BANDS[h]], list(s.get("band", [])))
        c.same(f"{cell}: recorded sha256 is the kept weights'", weights_sha256(results / cell),
               s.get("sha256"))
        if "items" in e:
            n = e["items"] - e.get("failed", 0)
            c.same(f"{cell}: evaluation games", EVAL_GAMES, e["items"])
            wins = float(success * n)
            c.same(f"{cell}: success a share of the games", True, wins.is_integer())
            low, high = proportion_confint(round(wins), n, method="wilson")
            for what, mine, theirs in (("low", low, e["success_ci95"][0]),
                                       ("high", high, e["success_ci95"][1])):
                c.agrees(f"{cell}: evaluation Wilson {what}", float(mine), f"{theirs:.6f}")
        a = finished_attempt(cell)
        if a is not None:
            warm = a["config"]["warm_start"]
            c.same(f"{cell}: demonstrations' and SFT's seeds", (100 + k, k),
                   (warm["settings"]["seed"], warm["train"]["seed"]))
            c.same(f"{cell}: the horizon's recipe", (h, DEMONSTRATOR_BANDS[h], 1024, 300, 16),
                   (warm["settings"]["horizon"], list(warm["settings"]["target_success"]),
                    warm["demonstrations"], warm["train"]["steps"], warm["train"]["batch_size"]))
    sha = {key: s.get("sha256") for key, s in ws.items()}

    # tuning and the rule
    choice_file = read_json(results / "tuning-choice.json")
    choice = {a: float(lr) for a, lr in choice_file["chosen"].items()}
    tuning: dict[tuple[str, float], dict] = {}
    for lr in LRS:
        for arm in ARMS:
            cell = f"tuning/lr{lr:g}/{arm}-seed{TUNING_SEED}"
            run = run_of(results / cell)
            if run is None:
                c.same(f"{cell}: neither finished nor failed 3 times", True, failed_out(cell))
                continue
            tuning[arm, lr] = run
            check_run(c, cell, run)
            e = finished_attempt(cell)
            if e is not None:
                check_attempt(c, e, cell, "short", arm, TUNING_SEED, lr,
                              "warm-starts/short/seed0", sha.get(("short", 0)))
    for arm in ARMS:
        # one tuning seed: an arm's mean at a rate is its one run's
        means = {lr: tuning[arm, lr]["success_f"] for lr in LRS if (arm, lr) in tuning}
        best = max(means.values(), default=None)
        rate = min(lr for lr, m in means.items() if m >= best - 1e-12) if means else FALLBACK_LR
        c.same(f"the rule's rate for {arm} (tuning-choice.json)", rate, choice[arm])
        for lr in LRS:
            row = choice_file.get("tuning", {}).get(arm, {}).get(f"{lr:g}", {})
            c.same(f"tuning-choice.json {arm} lr {lr:g} runs", int((arm, lr) in tuning),
                   row.get("runs"))
            if lr in means:
                c.agrees(f"tuning-choice.json {arm} lr {lr:g} mean", means[lr],
                       f"{row.get('mean', float('nan')):.9f}")

    # confirmation runs, their records
    values: dict[str, dict[str, dict[int, list[dict]]]] = {}
    registered = confirmation_cells(chosen)
    for h, k, arm, seed in registered:
        cell = conf_id(h, k, arm, seed)
        run = run_of(results / cell)
        if run is None:
            c.same(f"{cell}: neither finished nor failed 3 times", True, failed_out(cell))
            continue
        check_run(c, cell, run)
        run["cell"] = cell
        start = exact(float(ws[h, chosen[h][k - 1]]["evaluation"]["success"]))
        run["collapsed"] = float(run["success"] < start - COLLAPSE_DROP)
        values.setdefault(h, {}).setdefault(arm, {}).setdefault(k, []).append(run)
        e = finished_attempt(cell)
        if e is not None:
            ws_cell = f"warm-starts/{h}/seed{chosen[h][k - 1]}"
            check_attempt(c, e, cell, h, arm, seed, choice[arm], ws_cell,
                          sha.get((h, chosen[h][k - 1])))
            c.same(f"{cell}: manifest's warm start index", k, e["warm_start"])
    grid = set(expected_ws) | set(tuning_ids()) | {conf_id(*x) for x in registered}
    kept = {str(p.parent.relative_to(results)) for stage in ("warm-starts", "tuning",
            "confirmation") for p in (results / stage).glob("**/summary.json")}
    c.same("finished cells outside the registered grid", [], sorted(kept - grid))
    c.same("attempts of cells outside the registered grid", [],
           sorted(set(attempts) - grid))
    order = [x for x in expected_ws[:1] + tuning_ids() + expected_ws[1:]
             + [conf_id(*x) for x in registered] if x in attempts]
    first = next((i for i, (a, b) in enumerate(zip(order, attempts)) if a != b), None)
    c.same("cells attempted in the registered order (the first out of it)", None,
           None if first is None else f"{list(attempts)[first]}, where {order[first]} was due")
    for e in manifest:
        c.same(f"{e['cell']} ({e['started']}): clean tree at the registration commit",
               (False, True), (e["dirty"], str(e["commit"]).startswith(REGISTRATION_COMMIT)))
    packages = sorted({e["packages_sha256"][:12] for e in manifest if e["outcome"] == "finished"})
    if len(packages) > 1:
        c.notes.append(f"finished attempts ran with {len(packages)} package lists: {packages}")
    if "written" in choice_file:
        after_tuning = [e["started"] for e in manifest if e["stage"] in ("tuning",)]
        later = [e["started"] for e in manifest if e["stage"] == "confirmation" or
                 (e["stage"] == "warm-start" and e["cell"] != "warm-starts/short/seed0")]
        c.same("tuning-choice.json written once the tuning stage was settled, before the next",
               True, all(t <= choice_file["written"] for t in after_tuning)
               and all(choice_file["written"] <= t for t in later))

    # the progress line
    made = {stage: len(list((results / stage).glob("**/summary.json")))
            for stage in ("warm-starts", "tuning", "confirmation")}
    progress = (f"Progress: warm starts {made['warm-starts']} made, tuning {made['tuning']}/"
                f"{len(tuning_ids())}, confirmation {made['confirmation']}/"
                f"{WARM_STARTS * len(ARMS) * sum(RUNS.values())}; {len(manifest)} attempts "
                f"({sum(e['outcome'] == 'failed' for e in manifest)} failed, "
                f"{sum(e['outcome'] == 'stopped' for e in manifest)} stopped).")
    c.same("the progress line", progress,
           next((x for x in lines if x.startswith("Progress")), None))

    # the warm-start table
    rows = table(lines, "Warm starts (their own")
    c.same("warm-start table rows", [(h, k) for h in HORIZONS for k in range(MAX_CANDIDATES + 1)
                                     if (h, k) in ws], [(r[0], int(r[1])) for r in rows])
    for r in rows:
        h, k = r[0], int(r[1])
        s = ws.get((h, k))
        if s is None:
            continue
        what = f"warm-start table {h} seed{k}"
        c.agrees(f"{what} ε", s["demonstrator"]["epsilon"], r[2])
        c.agrees(f"{what} SFT loss", s["sft_loss"]["last10_mean"], r[3])
        for name, mine, text in zip(("success", "low", "high"),
                                    [s["evaluation"]["success"], *s["evaluation"]["success_ci95"]],
                                    sc.numbers(r[4])):
            c.agrees(f"{what} {name}", mine, text)
        band = BANDS[h][0] <= exact(float(s["evaluation"]["success"])) <= BANDS[h][1]
        c.same(f"{what} in band", "yes" if band else "no", r[5])
        used = ("tuning" if (h, k) == ("short", 0) else
                f"ws{chosen[h].index(k) + 1}" if k in chosen[h] else "not used")
        c.same(f"{what} used as", used, r[6])

    # the tuning table
    label = {v: k for k, v in ARMS.items()}
    rows = table(lines, "Tuning (short horizon")
    c.same("tuning table arms", list(ARMS), [label.get(r[0], r[0]) for r in rows])
    for r in rows:
        arm = label.get(r[0])
        for lr, text in zip(LRS, r[1:]):
            if (arm, lr) not in tuning:
                c.same(f"tuning {arm} lr {lr:g}", "no run", text)
                continue
            mean, n = sc.numbers(text)
            c.agrees(f"tuning {arm} lr {lr:g} mean", float(tuning[arm, lr]["success"]), mean)
            c.same(f"tuning {arm} lr {lr:g} runs", 1, int(n))
            c.same(f"tuning {arm} lr {lr:g} chosen (bold)", choice[arm] == lr, "**" in text)

    # per arm and horizon
    for h in HORIZONS:
        rows = table(lines, f"**{h} horizon**")
        per = values.get(h, {})
        c.same(f"{h} horizon table arms", [a for a in ARMS if a in per],
               [label.get(r[0], r[0]) for r in rows])
        for r in rows:
            arm = label.get(r[0])
            if arm not in per:
                continue
            runs = [x for k in sorted(per[arm]) for x in per[arm][k]]
            what = f"{h} horizon {arm}"
            c.same(f"{what} lr", choice[arm], float(r[1]))
            c.same(f"{what} runs", len(runs), int(r[2]))
            m, low, high, tabled = t_interval([x["success_f"] for x in runs])
            mean, lo, hi = sc.numbers(r[3])
            c.agrees(f"{what} mean", m, mean)
            c.within(f"{what} t-interval low", m - tabled, low, lo)
            c.within(f"{what} t-interval high", high, m + tabled, hi)
            for k, text in zip(range(1, WARM_STARTS + 1), r[4:4 + WARM_STARTS]):
                if k not in per[arm]:
                    c.same(f"{what} ws{k}", "—", text)
                else:
                    c.agrees(f"{what} ws{k} mean",
                           float(np.mean([x["success_f"] for x in per[arm][k]])), text)
            count = int(sum(x["collapsed"] for x in runs))
            wlow, whigh = proportion_confint(count, len(runs), method="wilson")
            n_c, rate, lo_c, hi_c = sc.numbers(r[4 + WARM_STARTS])
            c.same(f"{what} collapsed", count, int(n_c))
            for name, mine, text in (("rate", count / len(runs), rate), ("Wilson low", wlow, lo_c),
                                     ("Wilson high", whigh, hi_c)):
                c.agrees(f"{what} collapse {name}", float(mine), text)

    # the tests
    mine, notes = registered_tests(values)
    c.notes += notes
    for family, tests in mine.items():
        rows = table(lines, f"Tests, {family} (", required=False)
        c.same(f"Tests, {family}: comparisons", sorted(tests), sorted(r[0] for r in rows))
        for r in rows:
            t = tests.get(r[0])
            if t is None:
                continue
            what = f"Tests, {family}: {r[0]}"
            found = sc.numbers(r[1])
            c.agrees(f"{what} difference", t["difference"], found[0])
            if "low" in t:
                c.agrees(f"{what} 90 % interval low", t["low"], found[1])
                c.agrees(f"{what} 90 % interval high", t["high"], found[2])
            c.within(f"{what} p", t["p_low"], t["p_high"], r[2], 1e-9)
            c.within(f"{what} Holm p", t["holm_low"], t["holm_high"], r[3], 1e-9)
            if (t["holm"] <= ALPHA) != (float(r[3]) <= ALPHA):
                c.notes.append(f"{what}: Holm p {t['holm']:.4g} exactly, {r[3]} by the "
                               f"registered Monte Carlo: the verdicts at {ALPHA} differ")

    # every run
    rows = table(lines, "Every run")
    listed = [cell for cell in tuning_ids() + [conf_id(*x) for x in registered]
              if (results / cell / "summary.json").exists() or failed_out(cell)]
    c.same("the every-run table's cells", listed, [r[0] for r in rows])
    every = {**{f"tuning/lr{lr:g}/{a}-seed{TUNING_SEED}": r for (a, lr), r in tuning.items()},
             **{x["cell"]: x for per in values.values() for by in per.values()
                for xs in by.values() for x in xs}}
    for r in rows:
        if r[0] not in every:
            c.same(f"{r[0]}", f"missing ({MAX_ATTEMPTS} failed attempts)", r[1])
        else:
            c.agrees(f"{r[0]} final success", every[r[0]]["success_f"], r[1])
    return c, mine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, required=True,
                        help="the markdown `textworld_credit.py --report` wrote (its --out)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="the kept cells and the manifest (default: the study's)")
    args = parser.parse_args()
    gc.freeze()  # multipletests runs gc.collect() at each call: not over every module again
    c, exact_tests = check(args.results, args.report.read_text())
    for family in FAMILIES:
        print(f"exact permutation p, {family}: " + "; ".join(
            f"{name} {t['difference']:+.3f}, p {t['p']:.3g} (Holm {t['holm']:.3g})"
            for name, t in exact_tests[family].items()))
    return c.verdict(args.report)


if __name__ == "__main__":
    sys.exit(main())
