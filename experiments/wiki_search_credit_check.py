"""Study 4's registered analysis (docs/study-wiki-search.md), recomputed independently, and
compared with the report ``wiki_search_credit.py --report`` wrote.

Nothing of the project's is imported but ``stress_check.py``'s independent pieces (the
exact stratified permutation p, Holm by statsmodels, reading the report's tables; it
imports nothing of the project's either): this reads the kept files (each cell's
``summary.json`` and ``trainer/metrics.jsonl``, ``tuning-choice.json``, ``manifest.jsonl``,
the package lists) and the report, and recomputes every number in the report with numpy,
scipy and statsmodels, in their own venv (the project's venv has no scipy, and the study's
runs record that venv's packages). Written from the registration before the analysis
point, and tested on synthetic runs only (tests/test_wiki_search_credit.py):

    python3 -m venv /tmp/statcheck && /tmp/statcheck/bin/pip install numpy scipy statsmodels
    /tmp/statcheck/bin/python experiments/wiki_search_credit_check.py \
        --report runs/wiki-search-credit.md [--commit REGISTRATION_COMMIT]

What it recomputes, and how:
- the grid: every registered cell finished once, or failed 3 times, and none else; the
  cells attempted in the registered order (the tuning warm start, the 24 tuning runs, the
  candidates, the 48 confirmation runs: run index, horizon, warm start, arm); each finished
  run's recorded config: the arm's estimator and ``outcome_only`` (GRPO-OR only), its rate
  (tuning: its folder's; confirmation: the chosen one), the trainer's seed, the env's
  1000 + seed, 32 steps of 2 groups of 8, warm-up 2, ``max_staleness`` 2, every held-out
  item 4 times at temperature 1, no evaluation before, packed micro-batches of at most
  4096 tokens (deviation 1: runs at the registration commit ``f123f45`` had the trainer's
  default); the warm start it started from
  (the registration's, its recorded sha256 the warm start's kept one); one commit, a
  clean tree (the confirmation runs: a difference; the earlier stages: a note);
- the warm starts: the tuning warm start the pilot's sft64 (sha256 ``1d3bbcab…``), the
  candidates seed 11, 12, ... in order, each made or failed 3 times, the first 2 with a
  held-out tool-call rate inside [0.3, 0.9] at both horizons ws1 and ws2, none made after,
  at most 6; their SFT recipe and seeds;
- every run's final rates from its kept per-item counts (mean over items of the item's
  share of its samples), its steps, its held-out items;
- the learning-rate rule per arm and horizon from the tuning runs' final mean outcome
  (ties within 1e-12 to the smaller rate; no finished run: 4e-5), against
  ``tuning-choice.json`` (its choice, its table, written between the stages);
- the tables: means and 95 % t-intervals (scipy's quantile; the runner's table of t has 3
  decimals), per-warm-start means, the warm starts' rows, every run's numbers, the
  progress line;
- the tests, each family Holm by statsmodels' ``multipletests``: the stratified
  permutation p **exactly** (stress_check's convolution; 2 warm starts of 3 + 3 runs:
  C(6,3)^2 = 400 relabellings, which the runner enumerates too) on the unrounded rates
  (fractions from each run's per-item counts, integers at their common denominator; the
  kept 4-decimal rates only where no counts were kept); the one-sided sign-flip test
  exactly over all 2^n patterns with fractions (a warm start's rate from its per-item
  counts too); TOST from
  its formula (stratified D, Var = Σ (s²/n) / S², Welch-Satterthwaite df) with scipy.

Prints each difference (``DIFFERS:``), notes (``NOTE:``) where the registration reads two
ways or a record is unusual, what was checked, a summary line, and exits 1 when any
number differs by more than its printed rounding allows, else 0.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))

import stress_check as sc  # noqa: E402  (the stress study's check: imports nothing either)

RESULTS = REPO / "experiments" / "results" / "wiki-search-credit"
PILOT_WARM_START = REPO / "experiments" / "results" / "wiki-search-pilot" / "warm-start" / \
    "sft64" / "summary.json"
ENV = "wiki_search"
# the registration's design (docs/study-wiki-search.md); the labels are the report's
ARMS = {"grpo": "GRPO-OR (outcome only)", "grpo_merged": "GRPO-MR (summed turn rewards)",
        "mt_grpo": "MT-GRPO", "mt_grpo_unbiased": "MT-GRPO, unbiased baseline"}
TURN_ARMS = ("mt_grpo", "mt_grpo_unbiased")
HORIZONS = ("one_hop", "two_hop")
ITEMS = {"one_hop": 45, "two_hop": 34}
EVAL_SAMPLES = 4
BAND = (Fraction("0.3"), Fraction("0.9"))
LRS = (1e-5, 4e-5, 1.6e-4)
TUNING_RUN_SEED = 900
FALLBACK_LR = 4e-5
STEPS = 32
RUNS = 3
WARM_STARTS = 2
MAX_CANDIDATES = 6
CANDIDATE_SEED = 10
TUNING_SHA256 = "1d3bbcab"
RECIPE = {"demonstrations": 512, "steps": 64, "batch_size": 8, "lr": 8e-5,
          "oracle_direct_fraction": 0.3}
MARGIN = 0.08
ALPHA = 0.05
DRAWS = 100_000
MAX_ATTEMPTS = 3
# deviation 1 (docs/study-wiki-search.md): runs at the registration commit packed each
# micro-batch with the trainer's default budget (not in their config); every run after it,
# packed micro-batches of at most 4096 tokens
REGISTRATION = "f123f45"
MICRO_BATCH_TOKENS = 4096
FINAL = ("exact_match", "tool_success", "tool_call_rate")
PER_ITEM = {"tool_calls": "tool_call_rate", "tool_success": "tool_success",
            "exact_match": "exact_match"}  # per-item count columns -> rates
SCALE = 10_000  # kept rates have 4 decimals
FAMILIES = {
    "primary": [(h, "mt_grpo", "grpo", m) for h in HORIZONS
                for m in ("exact_match", "tool_success")],
    "secondary (a): mt_grpo_unbiased vs GRPO-OR": [
        (h, "mt_grpo_unbiased", "grpo", m) for h in HORIZONS
        for m in ("exact_match", "tool_success")],
    "secondary (b): turn-level arms vs GRPO-MR": [
        (h, arm, "grpo_merged", "exact_match") for h in HORIZONS for arm in TURN_ARMS],
    "secondary (c): GRPO-OR stops invoking the tool (one-sided)": [
        (h, "grpo", None, "tool_call_change") for h in HORIZONS],
    "secondary (d): GRPO-OR vs MT-GRPO, tool-call rate": [
        (h, "grpo", "mt_grpo", "tool_call_rate") for h in HORIZONS],
}


def ws_id(seed: int) -> str:
    return "warm-starts/tuning" if seed == 1 else f"warm-starts/seed{seed}"


def tuning_cells() -> list[tuple[str, str, float, str]]:
    """(horizon, arm, lr, cell): rate outermost, then horizon, then arm."""
    return [(h, arm, lr, f"tuning/{h}/lr{lr:g}/{arm}-seed{TUNING_RUN_SEED}")
            for lr in LRS for h in HORIZONS for arm in ARMS]


def confirmation_cells(n_ws: int) -> list[tuple[str, int, str, int, str]]:
    """(horizon, k, arm, seed, cell): run index, horizon, warm start, arm."""
    return [(h, k, arm, 400 + 10 * k + i, f"confirmation/{h}/ws{k}/{arm}-seed{400 + 10 * k + i}")
            for i in range(RUNS) for h in HORIZONS for k in range(1, n_ws + 1) for arm in ARMS]


def start_rate(evaluation: dict) -> Fraction:
    """A warm start's tool-call rate at a horizon, unrounded: from its per-item counts
    where it kept them, else the kept 4-decimal rate."""
    per_item, columns = evaluation.get("per_item"), evaluation.get("per_item_columns")
    if not per_item or not columns:
        return decimal(evaluation["tool_call_rate"])
    at = columns.index("tool_calls")
    return sum(Fraction(c[at], c[0]) for c in per_item.values()) / len(per_item)


def decimal(value: float) -> Fraction:
    """The decimal a kept (rounded) float stands for."""
    return Fraction(repr(float(value)))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


# --- the statistics, independently ---------------------------------------------------------

def permutation(x: list[list[Fraction]], y: list[list[Fraction]]) -> tuple[float, float]:
    """The stratified difference and its exact two-sided p (stress_check's convolution) of
    the unrounded rates (fractions), made integers by their common denominator (p does not
    change with the scale)."""
    scale = math.lcm(*(v.denominator for s in x + y for v in s))

    def scaled(strata: list[list[Fraction]]) -> list[list[float]]:
        return [[float(v * scale) for v in s] for s in strata]

    d, p = sc.exact_stratified_p(scaled(x), scaled(y))
    return d / scale, p


def relabellings(x: list[list], y: list[list]) -> int:
    return math.prod(math.comb(len(a) + len(b), len(a)) for a, b in zip(x, y))


def sign_flip(changes: list[Fraction]) -> tuple[float, float]:
    """Mean of the paired changes and its one-sided p: the share of all 2^n sign patterns
    whose mean is <= the observed one (exact, in fractions)."""
    observed = sum(changes)
    hits = sum(sum(s * d for s, d in zip(signs, changes)) <= observed
               for signs in itertools.product((1, -1), repeat=len(changes)))
    return float(observed / len(changes)), hits / 2 ** len(changes)


def tost(x: list[list[float]], y: list[list[float]]) -> dict[str, float]:
    """D = mean over the S strata of the within-stratum difference; Var(D) =
    Σ_s (s²_x,s/n_x,s + s²_y,s/n_y,s) / S², Welch-Satterthwaite df; p = max(P(T > (D + m)/se),
    P(T > (m - D)/se)); the 90 % interval D ± t_0.95 · se (stats.tost's docstring)."""
    S = len(x)
    d = float(np.mean([np.mean(a) - np.mean(b) for a, b in zip(x, y)]))
    terms = [(float(np.var(v, ddof=1)) / len(v) / S**2, len(v)) for a, b in zip(x, y)
             for v in (a, b)]
    var = sum(t for t, _ in terms)
    if var == 0:
        p = 0.0 if abs(d) < MARGIN else 1.0
        return {"difference": d, "low": d, "high": d, "p": p}
    df = var**2 / sum(t**2 / (n - 1) for t, n in terms)
    se = math.sqrt(var)
    p = float(max(stats.t.sf((d + MARGIN) / se, df), stats.t.sf((MARGIN - d) / se, df)))
    half = float(stats.t.ppf(0.95, df)) * se
    return {"difference": d, "low": d - half, "high": d + half, "p": p}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and the half-width of its 95 % t-interval (0 for one value), and the slack the
    runner's 3-decimal table of t quantiles allows (half a unit of the third decimal)."""
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, 0.0, 0.0
    se = float(np.std(values, ddof=1)) / math.sqrt(len(values))
    return mean, float(stats.t.ppf(0.975, len(values) - 1)) * se, 5e-4 * se


def strata(values: dict, a: str, b: str, key: str) -> tuple[list, list]:
    shared = sorted(set(values.get(a, {})) & set(values.get(b, {})))
    return ([[r[key] for r in values[a][k]] for k in shared],
            [[r[key] for r in values[b][k]] for k in shared])


def registered_tests(values: dict) -> tuple[dict[str, dict], list[str]]:
    """The families as registered (each Holm within), the equivalence family, and notes."""
    out: dict[str, dict] = {}
    notes: list[str] = []
    for family, members in FAMILIES.items():
        tests = {}
        for h, a, b, key in members:
            per = values.get(h, {})
            if b is None:
                changes = [r["change"] for k in sorted(per.get(a, {})) for r in per[a][k]]
                if changes:
                    if 2 ** len(changes) > DRAWS:
                        raise SystemExit(f"{h}: {len(changes)} GRPO-OR runs: the runner's "
                                         "sign-flip p is Monte Carlo, not checked here")
                    d, p = sign_flip(changes)
                    tests[f"{h}: {a}, final - warm start, tool_call_rate"] = {
                        "difference": d, "p": p}
                continue
            x, y = strata(per, a, b, key)
            if not x:
                continue
            if relabellings(x, y) > DRAWS:
                raise SystemExit(f"{h}: {a} - {b}: more than {DRAWS} relabellings")
            d, p = permutation(*strata(per, a, b, f"{key}_exact"))
            tests[f"{h}: {a} - {b}, {key}"] = {"difference": d, "p": p}
        out[family] = with_holm(tests)
    tests = {}
    for h in HORIZONS:
        x, y = strata(values.get(h, {}), "mt_grpo", "grpo", "exact_match")
        if x and all(len(v) >= 2 for v in x + y):
            tests[f"{h}: mt_grpo - grpo, exact_match"] = tost(x, y)
        elif x:
            kept = [(a, b) for a, b in zip(x, y) if len(a) >= 2 and len(b) >= 2]
            alt = (f"; with that warm start left out instead: {tost(*map(list, zip(*kept)))['p']:.4g}"
                   if kept else "")
            notes.append(f"equivalence, {h}: not made (a warm start has fewer than 2 runs of "
                         f"an arm; the registration does not say){alt}")
    out["equivalence"] = with_holm(tests)
    return out, notes


def with_holm(tests: dict[str, dict]) -> dict[str, dict]:
    for name, value in sc.holm({k: t["p"] for k, t in tests.items()}).items():
        tests[name]["holm"] = float(value)
    return tests


# --- the comparison ------------------------------------------------------------------------

class Checker(sc.Checker):
    """stress_check's, with notes, areas checked, and printed numbers against recomputed
    ones give or take their rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []
        self.areas: dict[str, int] = {}
        self.area = ""

    def count(self) -> None:
        self.checked += 1
        self.areas[self.area] = self.areas.get(self.area, 0) + 1

    def same(self, what: str, expected: object, found: object) -> None:
        self.areas[self.area] = self.areas.get(self.area, 0) + 1
        super().same(what, expected, found)

    def agrees(self, what: str, mine: float, text: str, extra: float = 0.0) -> None:
        """The printed number ``text`` equals ``mine`` give or take its rounding."""
        self.count()
        slack = sc.printed(text) + extra + 1e-12
        if not abs(float(text) - mine) <= slack:
            self.failed.append(f"{what}: recomputed {mine:.6g}, report {text}")

    def verdict(self, report: Path) -> int:
        print("checked: " + "; ".join(f"{area} {n}" for area, n in self.areas.items()))
        print("\n".join([f"NOTE: {x}" for x in self.notes] + [f"DIFFERS: {x}" for x in self.failed]
                        + [f"wiki search credit check: {self.checked - len(self.failed)} of "
                           f"{self.checked} numbers and facts in {report} recomputed "
                           "independently agree" + (f"; {len(self.failed)} differ"
                                                    if self.failed else " (all match)")]))
        return 1 if self.failed else 0


def table(lines: list[str], starts: str, required: bool = True) -> list[list[str]]:
    if not any(line.startswith(starts) for line in lines):
        if required:
            raise SystemExit(f"the report has no line starting with {starts!r}: is it the "
                             "output of `wiki_search_credit.py --report`?")
        return []
    return sc.table(lines, starts)


def run_of(folder: Path) -> dict[str, Any] | None:
    """A finished run's kept numbers: its final rates (4 decimals), the same recomputed
    from its per-item counts (fractions), mean outcome, steps, items."""
    summary = read_json(folder / "summary.json")
    if summary is None:
        return None
    rates = summary.get("after_rates", {})
    run = {m: float(rates[m]) for m in FINAL}
    run.update(mean_outcome=float(summary["after"][ENV]["mean_outcome"]),
               failed=summary["after"][ENV].get("failed"), items=rates.get("items"),
               episodes=rates.get("episodes"), stopped_early=summary.get("stopped_early"))
    metrics = folder / "trainer" / "metrics.jsonl"
    run["steps"] = ([json.loads(x).get("step") for x in metrics.read_text().splitlines()
                     if x.strip()] if metrics.exists() else [])
    columns, per_item = summary.get("after_per_item_columns"), summary.get("after_per_item")
    if columns and per_item:
        run["per_item"] = len(per_item)
        run["samples"] = sorted({counts[0] for counts in per_item.values()})
        for column, rate in PER_ITEM.items():
            at = columns.index(column)
            share = sum(Fraction(c[at], c[0]) for c in per_item.values()) / len(per_item)
            run[f"{rate}_exact"] = share
    for m in FINAL:  # the registered rate, unrounded: what the tables and tests use
        run[f"{m}_kept"] = run[m]
        run[f"{m}_exact"] = run.get(f"{m}_exact", decimal(run[m]))
        run[m] = float(run[f"{m}_exact"])
    return run


def check_run(c: Checker, cell: str, h: str, run: dict) -> None:
    steps = run["steps"]
    c.same(f"{cell}: metrics.jsonl steps 1..N", list(range(1, len(steps) + 1)), steps)
    if len(steps) != STEPS and run["stopped_early"] and 0 < len(steps) < STEPS:
        c.notes.append(f"{cell}: stopped early after {len(steps)} steps (max_batch_wait_s): "
                       "the registration says 32 steps and names no early stop")
    else:
        c.same(f"{cell}: {STEPS} steps", STEPS, len(steps))
    c.same(f"{cell}: final evaluation items", ITEMS[h], run["items"])
    if run["episodes"] != EVAL_SAMPLES * ITEMS[h] or run.get("failed"):
        c.notes.append(f"{cell}: final evaluation {run['episodes']} episodes, "
                       f"{run.get('failed')} failed (registered: {ITEMS[h]} items x 4)")
    c.same(f"{cell}: per-item counts kept for every item", ITEMS[h], run.get("per_item"))
    for m in FINAL:
        c.agrees(f"{cell}: final {m} (mean over items of the item's share)",
                 float(run[f"{m}_exact"]), f"{run[f'{m}_kept']:.4f}")
        c.same(f"{cell}: final {m} kept at 4 decimals", True,
               abs(run[f"{m}_kept"] * SCALE - round(run[f"{m}_kept"] * SCALE)) < 1e-6)


def check_attempt(c: Checker, e: dict, cell: str, h: str, arm: str, seed: int, lr: float,
                  ws_seed: int, ws_sha: str | None) -> None:
    config = e["config"]
    train, env = config["train"], config["envs"][0]["settings"]
    folder = "warm-start-sft64" + ("" if ws_seed == 1 else f"-seed{ws_seed}")
    for what, expected, found in (
            ("env", ENV, config["envs"][0]["name"]),
            ("rate", lr, float(train["lr"])), ("manifest rate", lr, float(e["lr"])),
            ("estimator", arm, train["estimator"]),
            ("outcome_only", arm == "grpo", bool(env.get("outcome_only", False))),
            ("trainer seed", seed, train["seed"]), ("env seed", 1000 + seed, env["seed"]),
            ("horizon", h, env["horizon"]), ("steps", STEPS, train["steps"]),
            ("eval_samples", EVAL_SAMPLES, env.get("eval_samples")),
            ("temperatures", (1.0, 1.0), (env["temperature"], env["eval_temperature"])),
            ("2 groups of 8 a step", (16, 8), (train["batch_size"], env["group_size"])),
            ("turns, tokens per turn, tokens", (4, 64, 2048),
             (env["max_turns"], env["max_tokens_per_turn"], env["max_token_length"])),
            ("warm-up steps", 2, train["warmup_steps"]),
            ("packed micro-batch tokens (deviation 1)",
             None if str(e["commit"]).startswith(REGISTRATION) else MICRO_BATCH_TOKENS,
             train.get("max_tokens_per_micro_batch")),
            ("max_staleness", 2, config["api"]["max_staleness"]),
            ("no evaluation before", False, config["evaluate_before"]),
            ("warm start cell", ws_id(ws_seed), e.get("warm_start_cell")),
            ("warm start weights folder", folder,
             Path(config["model"]).parent.parent.name)):
        c.same(f"{cell}: {what}", expected, found)
    c.same(f"{cell}: warm start sha256 (the warm start's kept one)", ws_sha,
           e.get("warm_start_sha256"))


def check_warm_start_attempt(c: Checker, e: dict, cell: str, seed: int) -> None:
    warm = e["config"]["warm_start"]
    c.same(f"{cell}: demonstrations' and SFT's seeds", (seed, seed),
           (warm["settings"]["seed"], warm["train"]["seed"]))
    c.same(f"{cell}: the recipe sft64", tuple(RECIPE.values()),
           (warm["demonstrations"], warm["train"]["steps"], warm["train"]["batch_size"],
            float(warm["train"]["lr"]), warm["settings"]["oracle_direct_fraction"]))


def check(results: Path, report: str, commit: str | None) -> tuple[Checker, dict]:
    c = Checker()
    lines = report.splitlines()
    manifest = [json.loads(x) for x in (results / "manifest.jsonl").read_text().splitlines()
                if x.strip()]
    attempts: dict[str, list[dict]] = {}
    for e in manifest:
        attempts.setdefault(e["cell"], []).append(e)

    def failed_out(cell: str) -> bool:
        return sum(e["outcome"] == "failed" for e in attempts.get(cell, [])) >= MAX_ATTEMPTS

    def settled(cell: str, finished: bool) -> None:
        """Finished once (its last attempt), or failed 3 times and never finished."""
        outcomes = [e["outcome"] for e in attempts.get(cell, [])]
        if finished:
            c.same(f"{cell}: one finished attempt, the last, after fewer than 3 failures",
                   (1, "finished", True), (outcomes.count("finished"), outcomes[-1] if outcomes
                                           else None, outcomes.count("failed") < MAX_ATTEMPTS))
        else:
            c.same(f"{cell}: neither finished nor failed 3 times", (0, MAX_ATTEMPTS),
                   (outcomes.count("finished"), outcomes.count("failed")))

    def finished_attempt(cell: str) -> dict | None:
        return next((e for e in attempts.get(cell, []) if e["outcome"] == "finished"), None)

    # --- warm starts
    c.area = "warm starts"
    ws: dict[int, dict] = {}
    for seed in (1, *range(CANDIDATE_SEED + 1, CANDIDATE_SEED + MAX_CANDIDATES + 1)):
        s = read_json(results / ws_id(seed) / "summary.json")
        if s is not None:
            ws[seed] = s
    in_band = {seed: all(BAND[0] <= decimal(s["evaluation"][h]["tool_call_rate"]) <= BAND[1]
                         for h in HORIZONS) for seed, s in ws.items()}
    chosen_ws: list[int] = []
    expected_ws = [ws_id(1)]
    for k in range(1, MAX_CANDIDATES + 1):
        seed = CANDIDATE_SEED + k
        if len(chosen_ws) == WARM_STARTS:
            c.same(f"{ws_id(seed)}: made or attempted though 2 were in the band already",
                   False, seed in ws or ws_id(seed) in attempts)
            continue
        expected_ws.append(ws_id(seed))
        settled(ws_id(seed), seed in ws)
        if seed in ws and in_band[seed]:
            chosen_ws.append(seed)
    c.same("the tuning warm start made", True, 1 in ws)
    pilot = read_json(PILOT_WARM_START)
    for seed, s in ws.items():
        cell, e = ws_id(seed), s["evaluation"]
        if seed == 1:
            c.same(f"{cell}: sha256 the pilot's sft64 ({TUNING_SHA256}…)", True,
                   str(s.get("sha256")).startswith(TUNING_SHA256))
            if pilot is not None:
                c.same(f"{cell}: sha256 the pilot's kept one", pilot["sha256"], s.get("sha256"))
        c.same(f"{cell}: seed, recipe", (seed, "sft64"), (s.get("seed"), s.get("recipe")))
        c.same(f"{cell}: band recorded", [0.3, 0.9], list(s.get("band", [])))
        c.same(f"{cell}: in_band recorded", in_band[seed], s.get("in_band"))
        for h in HORIZONS:
            rate = decimal(e[h]["tool_call_rate"])
            c.same(f"{cell} {h}: in_band recorded", BAND[0] <= rate <= BAND[1],
                   e[h].get("in_band"))
            c.same(f"{cell} {h}: held-out items", ITEMS[h], e[h].get("items"))
            if e[h].get("episodes") != EVAL_SAMPLES * ITEMS[h] or e[h].get("failed"):
                c.notes.append(f"{cell} {h}: {e[h].get('episodes')} episodes, "
                               f"{e[h].get('failed')} failed (registered: {ITEMS[h]} x 4)")
        if seed == 1:
            settled(cell, True)
        a = finished_attempt(cell)
        if a is not None:
            check_warm_start_attempt(c, a, cell, seed)
    sha = {seed: s.get("sha256") for seed, s in ws.items()}

    # --- tuning and the rule
    c.area = "tuning and the rule"
    choice_file = read_json(results / "tuning-choice.json")
    if choice_file is None:
        raise SystemExit(f"no tuning-choice.json under {results}")
    choice = {h: {a: float(lr) for a, lr in per.items()}
              for h, per in choice_file["chosen"].items()}
    tuning: dict[tuple[str, str, float], dict] = {}
    expected_tuning = tuning_cells() if 1 in ws else []
    if 1 not in ws:
        c.notes.append("the tuning warm start failed 3 times: no tuning run, every rate 4e-5 "
                       "(the registration does not say)")
    for h, arm, lr, cell in expected_tuning:
        run = run_of(results / cell)
        settled(cell, run is not None)
        if run is None:
            continue
        tuning[h, arm, lr] = run
        check_run(c, cell, h, run)
        e = finished_attempt(cell)
        if e is not None:
            check_attempt(c, e, cell, h, arm, TUNING_RUN_SEED, lr, 1, sha.get(1))
    for h in HORIZONS:
        for arm in ARMS:
            means = {lr: tuning[h, arm, lr]["mean_outcome"] for lr in LRS
                     if (h, arm, lr) in tuning}
            best = max(means.values(), default=None)
            rate = (min(lr for lr, m in means.items() if m >= best - 1e-12) if means
                    else FALLBACK_LR)
            c.same(f"the rule's rate for {arm} at {h} (tuning-choice.json)", rate,
                   choice.get(h, {}).get(arm))
            kept = choice_file.get("mean_outcome", {}).get(h, {}).get(arm, {})
            for lr in LRS:
                c.same(f"tuning-choice.json mean outcome {h} {arm} lr {lr:g}",
                       means.get(lr), kept.get(f"{lr:g}"))
    if "written" in choice_file:
        before = [e["started"] for e in manifest if e["cell"].startswith("tuning/")]
        after = [e["started"] for e in manifest if e["cell"].startswith("confirmation/")
                 or e["cell"].startswith("warm-starts/seed")]
        c.same("tuning-choice.json written after the last tuning attempt began, before the "
               "next stage", True, all(t <= choice_file["written"] for t in before)
               and all(choice_file["written"] <= t for t in after))

    # --- confirmation runs, their records
    c.area = "confirmation grid"
    values: dict[str, dict[str, dict[int, list[dict]]]] = {}
    registered = confirmation_cells(len(chosen_ws))
    if len(chosen_ws) < WARM_STARTS:
        c.notes.append(f"only {len(chosen_ws)} candidates in the band: the confirmation "
                       f"grid has {len(registered)} cells")
    for h, k, arm, seed, cell in registered:
        run = run_of(results / cell)
        settled(cell, run is not None)
        if run is None:
            continue
        check_run(c, cell, h, run)
        run.update(cell=cell, change=run["tool_call_rate_exact"]
                   - start_rate(ws[chosen_ws[k - 1]]["evaluation"][h]))
        values.setdefault(h, {}).setdefault(arm, {}).setdefault(k, []).append(run)
        e = finished_attempt(cell)
        if e is not None:
            check_attempt(c, e, cell, h, arm, seed, choice[h][arm], chosen_ws[k - 1],
                          sha.get(chosen_ws[k - 1]))
            c.same(f"{cell}: manifest's warm start index", k, e.get("warm_start"))

    # --- the whole grid: nothing else, the order, the commit, the packages
    c.area = "grid, order, commit"
    grid = set(expected_ws) | {x[-1] for x in expected_tuning} | {x[-1] for x in registered}
    kept = {str(p.parent.relative_to(results)) for stage in ("warm-starts", "tuning",
            "confirmation") for p in (results / stage).glob("**/summary.json")}
    c.same("finished cells outside the registered grid", [], sorted(kept - grid))
    c.same("attempts of cells outside the registered grid", [], sorted(set(attempts) - grid))
    order = [x for x in expected_ws[:1] + [t[-1] for t in expected_tuning] + expected_ws[1:]
             + [x[-1] for x in registered] if x in attempts]
    ran = [e["cell"] for i, e in enumerate(manifest) if i == 0 or
           manifest[i - 1]["cell"] != e["cell"]]
    first = next((i for i in range(max(len(order), len(ran))) if i >= len(order)
                  or i >= len(ran) or order[i] != ran[i]), None)
    c.same("cells attempted in the registered order, each until settled (the first out of "
           "it)", None, None if first is None else
           f"{ran[first] if first < len(ran) else 'nothing'}, where "
           f"{order[first] if first < len(order) else 'nothing'} was due")
    confirmation = [e for e in manifest if e["cell"].startswith("confirmation/")]
    commits = sorted({str(e["commit"]) for e in confirmation})
    if confirmation:
        c.same("the confirmation runs' commits (one)", 1, len(commits))
    if commit is not None:
        c.same(f"the confirmation runs at the registration commit {commit}", [True],
               sorted({x.startswith(commit) for x in commits}) or [True])
    c.same("confirmation attempts with a dirty tree", [],
           [f"{e['cell']} ({e['started']})" for e in confirmation if e["dirty"]])
    earlier = [e for e in manifest if not e["cell"].startswith("confirmation/")
               and (e["dirty"] or (commits and e["commit"] != commits[0]))]
    if earlier:
        c.notes.append(f"{len(earlier)} attempts before the confirmation stage ran at another "
                       "commit or with a dirty tree (the registration: every run at the "
                       f"registration commit), e.g. {earlier[0]['cell']}")
    packages = sorted({e["packages_sha256"] for e in manifest if e["outcome"] == "finished"})
    if len(packages) > 1:
        c.notes.append(f"finished attempts ran with {len(packages)} package lists: "
                       f"{[p[:12] for p in packages]}")
    for digest in packages:
        listing = results / "packages" / f"{digest}.txt"
        c.same(f"package list {digest[:12]} kept, its sha256 its name", digest,
               hashlib.sha256(listing.read_bytes()).hexdigest() if listing.exists() else None)

    check_report(c, lines, results, manifest, ws, chosen_ws, choice, tuning, values,
                 expected_tuning, registered, failed_out)
    mine, notes = registered_tests(values)
    c.notes += notes
    check_tests(c, lines, mine)
    return c, mine


def check_report(c: Checker, lines: list[str], results: Path, manifest: list[dict],
                 ws: dict[int, dict], chosen_ws: list[int], choice: dict, tuning: dict,
                 values: dict, expected_tuning: list, registered: list, failed_out: Any
                 ) -> None:
    """The report's progress line and tables against the kept files."""
    c.area = "report tables"
    made = {stage: len(list((results / stage).glob("**/summary.json")))
            for stage in ("warm-starts", "tuning", "confirmation")}
    progress = (f"Progress: warm starts {made['warm-starts']} made, tuning {made['tuning']}/"
                f"{len(LRS) * len(HORIZONS) * len(ARMS)}, confirmation {made['confirmation']}/"
                f"{len(HORIZONS) * len(ARMS) * WARM_STARTS * RUNS}; {len(manifest)} attempts "
                f"({sum(e['outcome'] == 'failed' for e in manifest)} failed, "
                f"{sum(e['outcome'] == 'stopped' for e in manifest)} stopped).")
    c.same("the progress line", progress, next((x for x in lines if x.startswith("Progress")),
                                               None))
    # the warm starts
    rows = table(lines, "Warm starts (recipe")
    c.same("warm-start table rows", [ws_id(s) for s in ws], [r[0] for r in rows])
    seed_of = {ws_id(s): s for s in ws}
    for r in rows:
        s = ws.get(seed_of.get(r[0]))
        if s is None:
            continue
        what = f"warm-start table {r[0]}"
        c.same(f"{what} sha256", s["sha256"][:12], r[1])
        losses = [x["loss"] for x in s.get("sft_steps") or [] if x.get("loss") is not None]
        if losses:
            for name, mine, text in zip(("first", "last"), (losses[0], losses[-1]),
                                        sc.numbers(r[2])):
                c.agrees(f"{what} SFT loss {name}", mine, text)
        else:
            c.same(f"{what} SFT loss", "—", r[2])
        for i, h in enumerate(HORIZONS):
            e = s["evaluation"][h]
            for name, mine, text in zip(("tool-call rate", "low", "high"),
                                        [e["tool_call_rate"], *e["tool_call_rate_ci95"]],
                                        sc.numbers(r[3 + 2 * i])):
                c.agrees(f"{what} {h} {name}", mine, text)
            c.agrees(f"{what} {h} exact match", e["exact_match"], r[4 + 2 * i])
        seed = seed_of[r[0]]
        band = all(BAND[0] <= decimal(s["evaluation"][h]["tool_call_rate"]) <= BAND[1]
                   for h in HORIZONS)
        c.same(f"{what} in band", "yes" if band else "no", r[3 + 2 * len(HORIZONS)])
        used = ("tuning" if seed == 1 else f"ws{chosen_ws.index(seed) + 1}" if seed in chosen_ws
                else "not used")
        c.same(f"{what} used as", used, r[4 + 2 * len(HORIZONS)])
    # tuning, per horizon
    label = {v: k for k, v in ARMS.items()}
    for h in HORIZONS:
        rows = table(lines, f"Tuning, {h} (tuning warm start")
        c.same(f"tuning table {h}: arms", list(ARMS), [label.get(r[0], r[0]) for r in rows])
        for r in rows:
            arm = label.get(r[0])
            for lr, text in zip(LRS, r[1:]):
                what = f"tuning table {h} {arm} lr {lr:g}"
                if (h, arm, lr) not in tuning:
                    c.same(what, "no run", text)
                    continue
                c.agrees(f"{what} mean outcome", tuning[h, arm, lr]["mean_outcome"],
                         text.strip("*"))
                c.same(f"{what} chosen (bold)", choice[h][arm] == lr, text.startswith("**"))
    # per arm and horizon
    for h in HORIZONS:
        rows = table(lines, f"**{h}**: final held-out rates")
        per = values.get(h, {})
        c.same(f"{h} table arms", [a for a in ARMS if a in per],
               [label.get(r[0], r[0]) for r in rows])
        for r in rows:
            arm = label.get(r[0])
            if arm not in per:
                continue
            runs = [x for k in sorted(per[arm]) for x in per[arm][k]]
            what = f"{h} table {arm}"
            c.same(f"{what} lr", choice[h][arm], float(r[1]))
            c.same(f"{what} runs", len(runs), int(r[2]))
            for m, cell in zip(FINAL, r[3:6]):
                mean, half, slack = t_interval([x[m] for x in runs])
                found = sc.numbers(cell)
                c.agrees(f"{what} {m} mean", mean, found[0])
                c.agrees(f"{what} {m} 95 % t-interval low", mean - half, found[1], slack)
                c.agrees(f"{what} {m} 95 % t-interval high", mean + half, found[2], slack)
            for k, text in zip(range(1, WARM_STARTS + 1), r[6:6 + WARM_STARTS]):
                if k not in per[arm]:
                    c.same(f"{what} ws{k}", "—", text)
                else:
                    c.agrees(f"{what} ws{k} mean exact match",
                             float(np.mean([x["exact_match"] for x in per[arm][k]])), text)
    # every run
    rows = table(lines, "Every run")
    listed = [cell for cell in [t[-1] for t in expected_tuning] + [x[-1] for x in registered]
              if (results / cell / "summary.json").exists() or failed_out(cell)]
    shown = [r[0] for r in rows]
    c.same("the every-run table: cells kept or failed 3 times but not listed", [],
           [x for x in listed if x not in shown])
    c.same("the every-run table: cells listed but neither kept nor failed 3 times", [],
           [x for x in shown if x not in listed])
    c.same("the every-run table in the registered order", True,
           [x for x in shown if x in listed] == [x for x in listed if x in shown])
    every = {**{cell: tuning[h, arm, lr] for h, arm, lr, cell in expected_tuning
                if (h, arm, lr) in tuning},
             **{x["cell"]: x for per in values.values() for by in per.values()
                for xs in by.values() for x in xs}}
    for r in rows:
        run = every.get(r[0])
        if run is None:
            c.same(r[0], f"missing ({MAX_ATTEMPTS} failed attempts)", r[1])
            continue
        found = sc.numbers(r[1])
        for m, text in zip(FINAL, found):
            c.agrees(f"{r[0]} final {m}", run[m], text)
        if r[0].startswith("tuning/"):
            c.agrees(f"{r[0]} mean outcome", run["mean_outcome"], found[3])
        c.same(f"{r[0]} numbers in its row", 4 if r[0].startswith("tuning/") else 3,
               len(found))


def check_tests(c: Checker, lines: list[str], mine: dict[str, dict]) -> None:
    c.area = "tests"
    for family, tests in mine.items():
        rows = table(lines, f"Tests, {family} (", required=bool(tests))
        header = next((x for x in lines if x.startswith(f"Tests, {family} (")), "")
        if tests:
            sided = ("TOST, 90 % interval" if family == "equivalence" else
                     "one-sided" if "(c)" in family else "two-sided")
            c.same(f"Tests, {family}: says {sided}", True, f" ({sided};" in header)
            if family == "equivalence":
                c.same(f"Tests, {family}: margin", True, f"margin ±{MARGIN}" in header)
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
            c.agrees(f"{what} p", t["p"], r[2], 1e-9)
            c.agrees(f"{what} Holm p", t["holm"], r[3], 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, required=True,
                        help="the markdown `wiki_search_credit.py --report` wrote (its --out)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="the kept cells and the manifest (default: the study's)")
    parser.add_argument("--commit", default=None,
                        help="the registration commit (a prefix): the confirmation runs' own")
    args = parser.parse_args()
    gc.freeze()  # multipletests runs gc.collect() at each call: not over every module again
    c, tests = check(args.results, args.report.read_text(), args.commit)
    for family, found in tests.items():
        print(f"exact p, {family}: " + ("; ".join(
            f"{name} {t['difference']:+.3f}, p {t['p']:.4g} (Holm {t['holm']:.4g})"
            for name, t in found.items()) or "none"))
    return c.verdict(args.report)


if __name__ == "__main__":
    sys.exit(main())
