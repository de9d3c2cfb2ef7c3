"""Study 3 (docs/study-textworld-credit.md): does turn-level credit pay off at a long
horizon? Six arms on TextWorld's cooking games at two horizons, each arm at a learning
rate a registered rule picked, across independently trained warm starts. Resumable.

    python experiments/textworld_credit.py --lock /tmp/lachesis-heavy.lock   # to the end
    python experiments/textworld_credit.py --one      # the next cell, then exit
    python experiments/textworld_credit.py --status   # counts only, no outcome
    python experiments/textworld_credit.py --report   # the registered analysis

Cells, in the order they run:

1. ``warm-starts/short/seed0``: the tuning warm start (``configs/textworld.yaml``'s recipe,
   ``experiments/textworld_warm_starts.py``'s seed 0).
2. ``tuning/lrLR/ARM-seedS``: every arm at every learning rate on the short horizon,
   tuning seeds outermost.
3. ``tuning-choice.json``: the registered rule picks each arm's rate, once every tuning
   cell is settled (finished, or failed ``MAX_ATTEMPTS`` times).
4. ``warm-starts/HORIZON/seedK``, K = 1, 2, ...: candidates, in seed order, until
   ``WARM_STARTS`` of them are inside ``BANDS`` (or ``MAX_CANDIDATES`` were tried); those
   are the horizon's confirmation warm starts ws1..ws4.
5. ``confirmation/HORIZON/wsK/ARM-seedS``: every arm of the horizon at its chosen rate;
   run index outermost, then horizon, warm start, arm, so a study cut short stays
   balanced.

A run works under ``--runs-dir`` (not kept); a finished cell's summary and metrics go to
``RESULTS`` (tracked) and a cell is finished when its ``summary.json`` is there; a warm
start's weights are kept there too, with their hash, and runs start from a copy checked
against it. Every attempt appends a line to ``RESULTS/manifest.jsonl`` (commit, dirty
tree, packages' hash, full config, seconds, outcome). The building blocks come from
``confirmatory.py`` and ``stress.py``, the warm starts from ``textworld_warm_starts.py``,
the tests from ``stats.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))

import confirmatory as cf  # noqa: E402
import stress as st  # noqa: E402
import textworld_warm_starts as tws  # noqa: E402
from stats import holm, stratified_permutation, t_interval, t_sf, tost, wilson  # noqa: E402

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import run_quietly  # noqa: E402

ENV = "textworld_cooking"
CONFIGS = {"short": REPO / "configs" / "textworld.yaml",
           "long": REPO / "configs" / "textworld-long.yaml"}
# arm -> (label, trainer settings), in the registered order
ARMS = {
    "grpo": ("GRPO-OR (outcome)", {"estimator": "grpo"}),
    "grpo_merged": ("GRPO-MR (summed turn rewards)", {"estimator": "grpo_merged"}),
    "mt_grpo": ("MT-GRPO", {"estimator": "mt_grpo"}),
    "mt_grpo_unbiased": ("MT-GRPO, unbiased baseline", {"estimator": "mt_grpo_unbiased"}),
    "turn_rtg": ("turn-RTG", {"estimator": "turn_rtg"}),
    "gigpo": ("GiGPO", {"estimator": "gigpo"}),
}
BASELINES = ("grpo", "grpo_merged")
CREDIT_ARMS = ("mt_grpo", "mt_grpo_unbiased", "turn_rtg", "gigpo")
LRS = (1e-4, 3e-4, 1e-3)
TUNING_SEEDS = (300,)
FALLBACK_LR = 3e-4  # configs/textworld.yaml's rate
# a confirmation warm start's held-out success (its own evaluation), per horizon: the long
# recipe's policies win far less than their demonstrator (the pilot: 0.086 and 0.129)
BANDS = {"short": (0.25, 0.55), "long": (0.08, 0.30)}
WARM_STARTS = 4
MAX_CANDIDATES = 8
TUNING_WARM_START = 0
# per horizon: RL steps, the held-out games of each run's final evaluation, runs per arm
# and warm start, the arms
HORIZON_DESIGN = {
    "short": {"steps": 40, "eval_items": 256, "runs": 2, "arms": tuple(ARMS)},
    "long": {"steps": 40, "eval_items": 256, "runs": 3, "arms": tuple(ARMS)},
}
RESULTS = REPO / "experiments" / "results" / "textworld-credit"
MAX_ATTEMPTS = cf.MAX_ATTEMPTS
MAX_BATCH_WAIT_S = 900  # an RL run with no trainable batch this long ends training early
ALPHA = 0.05
MARGIN = 0.05  # equivalence margin on final held-out success (TOST)
COLLAPSE_DROP = 0.10  # collapsed: final success below the warm start's by more than this
DRAWS = 100_000
PERMUTATION_SEED = 20261202


def confirmation_seed(horizon: str, ws: int, i: int) -> int:
    """The ``i``-th run from warm start ``ws`` (1..4): 400.. short, 500.. long."""
    return {"short": 400, "long": 500}[horizon] + 10 * (ws - 1) + i


class Design(NamedTuple):
    lrs: tuple[float, ...] = LRS
    tuning_seeds: tuple[int, ...] = TUNING_SEEDS
    horizons: tuple[str, ...] = ("short", "long")
    steps: dict[str, int] | None = None  # smoke runs: RL steps per horizon
    runs: dict[str, int] | None = None  # smoke runs: runs per arm and warm start
    arms: tuple[str, ...] = tuple(ARMS)  # smoke runs: a subset
    tuning_horizon: str = "short"  # pilots: the long horizon's tuning stage

    @property
    def registered(self) -> bool:
        return self == Design()

    def of(self, horizon: str) -> dict[str, Any]:
        design = dict(HORIZON_DESIGN[horizon])
        if self.steps:
            design["steps"] = self.steps[horizon]
        if self.runs:
            design["runs"] = self.runs[horizon]
        design["arms"] = tuple(a for a in design["arms"] if a in self.arms)
        return design


class Cell(NamedTuple):
    stage: str  # warm-start, tuning, confirmation
    horizon: str
    ws: int  # warm-start: the candidate's seed; tuning: 0; confirmation: 1..4
    arm: str | None = None
    seed: int | None = None
    lr: float | None = None

    @property
    def id(self) -> str:
        if self.stage == "warm-start":
            return f"warm-starts/{self.horizon}/seed{self.ws}"
        if self.stage == "tuning":
            return f"tuning/lr{self.lr:g}/{self.arm}-seed{self.seed}"
        return f"confirmation/{self.horizon}/ws{self.ws}/{self.arm}-seed{self.seed}"

    @property
    def group(self) -> str:
        return self.id.rsplit("/", 1)[0]


# --- the grid -------------------------------------------------------------------------

def summary_of(results: Path, cell: Cell) -> dict[str, Any] | None:
    path = results / cell.id / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def settled(results: Path, manifest: list[dict[str, Any]], cell: Cell) -> bool:
    return (summary_of(results, cell) is not None or
            st.failures(manifest, cell) >= MAX_ATTEMPTS)


def in_band(summary: dict[str, Any], horizon: str) -> bool:
    lo, hi = BANDS[horizon]
    return lo <= summary["evaluation"]["success"] <= hi


def confirmation_warm_starts(results: Path, horizon: str) -> tuple[list[int], int | None]:
    """The horizon's confirmation warm starts (candidate seeds, in order, the first
    ``WARM_STARTS`` inside ``BANDS``) and the next candidate to make (None: none needed)."""
    manifest = cf.read_manifest(results)
    chosen = []
    for seed in range(1, MAX_CANDIDATES + 1):
        cell = Cell("warm-start", horizon, seed)
        summary = summary_of(results, cell)
        if summary is None:
            if st.failures(manifest, cell) >= MAX_ATTEMPTS:
                continue
            return chosen, seed
        if in_band(summary, horizon):
            chosen.append(seed)
            if len(chosen) == WARM_STARTS:
                return chosen, None
    return chosen, None


def tuning_cells(design: Design) -> list[Cell]:
    horizon = design.tuning_horizon
    return [Cell("tuning", horizon, TUNING_WARM_START, arm, seed, lr)
            for seed in design.tuning_seeds for lr in design.lrs
            for arm in design.of(horizon)["arms"]]


def confirmation_cells(design: Design, chosen: dict[str, float]) -> list[Cell]:
    longest = max(design.of(h)["runs"] for h in design.horizons)
    return [Cell("confirmation", h, ws, arm, confirmation_seed(h, ws, i), chosen[arm])
            for i in range(longest) for h in design.horizons if i < design.of(h)["runs"]
            for ws in range(1, WARM_STARTS + 1) for arm in design.of(h)["arms"]]


def choose(results: Path, design: Design) -> dict[str, Any]:
    """The registered rule, once: per arm, the rate with the best mean final held-out
    success over its finished tuning runs; ties to the smaller rate; no finished run:
    ``FALLBACK_LR``. Written to ``tuning-choice.json`` and from then on read."""
    path = results / "tuning-choice.json"
    if path.exists():
        return json.loads(path.read_text())
    chosen, means = {}, {}
    for arm in design.of(design.tuning_horizon)["arms"]:
        rows = {}
        for lr in sorted(design.lrs):
            values = [final_success(summary_of(results, c)) for c in tuning_cells(design)
                      if c.arm == arm and c.lr == lr and summary_of(results, c)]
            if values:
                rows[lr] = sum(values) / len(values)
            means.setdefault(arm, {})[f"{lr:g}"] = {"runs": len(values), "mean": rows.get(lr)}
        best = max(rows.values(), default=None)
        chosen[arm] = (min(lr for lr, m in rows.items() if m >= best - 1e-12)
                       if rows else FALLBACK_LR)
    choice = {"rule": "best mean final held-out success over the tuning runs; ties to the "
                      "smaller rate", "chosen": chosen, "tuning": means,
              "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(choice, indent=2))
    path.with_suffix(".tmp").rename(path)
    return choice


def next_cell(results: Path, design: Design) -> Cell | None:
    manifest = cf.read_manifest(results)
    tuning_start = Cell("warm-start", design.tuning_horizon, TUNING_WARM_START)
    if not settled(results, manifest, tuning_start):
        return tuning_start
    if summary_of(results, tuning_start):
        for cell in tuning_cells(design):
            if not settled(results, manifest, cell):
                return cell
    chosen = {arm: float(lr) for arm, lr in choose(results, design)["chosen"].items()}
    ready = {}
    for horizon in design.horizons:
        seeds, candidate = confirmation_warm_starts(results, horizon)
        if candidate is not None:
            return Cell("warm-start", horizon, candidate)
        ready[horizon] = len(seeds)
    for cell in confirmation_cells(design, chosen):
        if cell.ws <= ready[cell.horizon] and not settled(results, manifest, cell):
            return cell
    return None


def progress(results: Path, design: Design) -> str:
    """Counts per stage (no outcome of any run)."""
    manifest = cf.read_manifest(results)
    count = lambda folder: (sum(1 for _ in (results / folder).glob("**/summary.json"))
                            if (results / folder).exists() else 0)
    planned = sum(len(design.of(h)["arms"]) * WARM_STARTS * design.of(h)["runs"]
                  for h in design.horizons)
    outcomes = {o: sum(e["outcome"] == o for e in manifest) for o in ("failed", "stopped")}
    return (f"warm starts {count('warm-starts')} made, tuning {count('tuning')}/"
            f"{len(tuning_cells(design))}, confirmation {count('confirmation')}/{planned}; "
            f"{len(manifest)} attempts ({outcomes['failed']} failed, "
            f"{outcomes['stopped']} stopped)")


# --- one cell -----------------------------------------------------------------------------

def make_warm_start(args: argparse.Namespace, cell: Cell) -> dict[str, Any]:
    """The horizon's recipe at the candidate's seed (``textworld_warm_starts``: its SFT
    and its evaluation on the held-out games, reused when that script made it before)."""
    return tws.run_seed(cell.ws, args.runs_dir / "warm-starts" / cell.horizon,
                        CONFIGS[cell.horizon])


def keep_warm_start(results: Path, cell: Cell, made: dict[str, Any]) -> None:
    kept = results / cell.id
    if kept.exists():
        shutil.rmtree(kept)
    shutil.copytree(made["model"], kept, ignore=shutil.ignore_patterns("trainer_state.pt"))
    summary = {**{k: made[k] for k in ("seed", "demonstrator", "warm_start_seconds",
                                       "evaluation_seconds", "sft_loss", "evaluation")},
               "horizon": cell.horizon, "in_band": in_band(made, cell.horizon),
               "band": BANDS[cell.horizon],
               "sha256": cf.weights_hash(str(kept))}
    done = kept / "summary.json"
    done.with_suffix(".tmp").write_text(json.dumps(summary, indent=2))
    done.with_suffix(".tmp").rename(done)


def warm_start_of(results: Path, cell: Cell) -> Cell:
    """The warm-start cell an RL cell starts from."""
    if cell.stage == "tuning":
        return Cell("warm-start", cell.horizon, TUNING_WARM_START)
    seeds, _ = confirmation_warm_starts(results, cell.horizon)
    return Cell("warm-start", cell.horizon, seeds[cell.ws - 1])


def warm_start_model(args: argparse.Namespace, ws_cell: Cell) -> tuple[str, str]:
    """The kept weights, copied under ``--runs-dir``, checked against the recorded hash."""
    kept = args.results / ws_cell.id
    recorded = json.loads((kept / "summary.json").read_text())["sha256"]
    model = args.runs_dir / "models" / ws_cell.horizon / f"seed{ws_cell.ws}"
    if not model.exists() or cf.weights_hash(str(model)) != recorded:
        if model.exists():
            shutil.rmtree(model)
        shutil.copytree(kept, model, ignore=shutil.ignore_patterns("summary.json"))
    digest = cf.weights_hash(str(model))
    if digest != recorded:
        raise SystemExit(f"{ws_cell.id}: weights hash {digest[:12]} is not the recorded "
                         f"{recorded[:12]}")
    return str(model), digest


def rl_config(args: argparse.Namespace, design: Design, cell: Cell, model: str) -> RunConfig:
    """The horizon's config with the arm's estimator, the seed (the trainer's, and the
    env's item order: every arm of a seed sees the same games), the rate; no warm start,
    the final evaluation only (the starting policy's is its warm start's)."""
    horizon = design.of(cell.horizon)
    values = yaml.safe_load(CONFIGS[cell.horizon].read_text())
    values.update(name=f"{cell.arm}-seed{cell.seed}", model=model, warm_start=None,
                  build_tiny_model=False, evaluate_before=False,
                  runs_dir=str(args.runs_dir / cell.group))
    values["train"].update(**ARMS[cell.arm][1], seed=cell.seed, lr=cell.lr,
                           steps=horizon["steps"], checkpoint_every=horizon["steps"],
                           max_batch_wait_s=MAX_BATCH_WAIT_S)
    env = values["envs"][0]["settings"]
    env.update(seed=1000 + cell.seed, eval_items=horizon["eval_items"])
    return RunConfig.model_validate(values)


def run_one(args: argparse.Namespace, design: Design, cell: Cell) -> str:
    entry = {**st.entry_for(args, cell), "horizon": cell.horizon}
    if cell.stage == "warm-start":
        entry["config"] = tws.seed_config(cell.ws, args.runs_dir / "warm-starts" / cell.horizon,
                                          CONFIGS[cell.horizon])
        return cf.attempt(args.results, entry, lambda: make_warm_start(args, cell),
                          lambda made: keep_warm_start(args.results, cell, made))
    ws_cell = warm_start_of(args.results, cell)
    model, digest = warm_start_model(args, ws_cell)
    config = rl_config(args, design, cell, model)
    entry.update(warm_start_cell=ws_cell.id, warm_start_sha256=digest,
                 config=config.model_dump(mode="json"))
    return cf.attempt(args.results, entry, lambda: run_quietly(config),
                      lambda summary: cf.keep(config.run_dir, args.results / cell.group,
                                              summary))


def check_design(args: argparse.Namespace, design: Design) -> None:
    """Every config the grid makes is valid before anything runs."""
    try:
        for horizon in design.horizons:
            RunConfig.model_validate(tws.seed_config(0, args.runs_dir, CONFIGS[horizon]))
            for arm in design.of(horizon)["arms"]:
                rl_config(args, design, Cell("confirmation", horizon, 1, arm, 0, 3e-4),
                          "warm-start").check_sections()
    except ValueError as error:
        raise SystemExit(f"textworld credit study: {error}") from None


# --- the registered analysis ----------------------------------------------------------------

def final_success(summary: dict[str, Any]) -> float:
    return float(summary["after"][ENV]["success"])


def run_rows(results: Path, design: Design, chosen: dict[str, float]
             ) -> dict[str, dict[str, dict[int, list[dict[str, float]]]]]:
    """horizon -> arm -> warm start -> finished runs' values: final success, collapsed."""
    rows: dict[str, dict[str, dict[int, list[dict[str, float]]]]] = {}
    for cell in confirmation_cells(design, chosen):
        summary = summary_of(results, cell)
        if summary is None:
            continue
        start = summary_of(results, warm_start_of(results, cell))["evaluation"]["success"]
        value = final_success(summary)
        rows.setdefault(cell.horizon, {}).setdefault(cell.arm, {}).setdefault(
            cell.ws, []).append({"success": value,
                                 "collapsed": float(value < start - COLLAPSE_DROP)})
    return rows


def strata(values: dict[str, dict[int, list[dict[str, float]]]], a: str, b: str, key: str
           ) -> tuple[list[list[float]], list[list[float]]]:
    shared = sorted(set(values.get(a, {})) & set(values.get(b, {})))
    return ([[r[key] for r in values[a][ws]] for ws in shared],
            [[r[key] for r in values[b][ws]] for ws in shared])


def registered_tests(rows: dict[str, Any]) -> dict[str, Any]:
    """Primary: at the long horizon, each credit arm against GRPO-OR and against GRPO-MR,
    final held-out success, the permutation test stratified by warm start, Holm over the
    eight. Secondary (each family Holm): the same at the short horizon; collapse at each
    horizon; the horizon interaction (the long-horizon difference minus the short's,
    against GRPO-MR, a Welch t-test on the two stratified differences); TOST."""
    out: dict[str, Any] = {}
    for family, horizon, key in [("primary: long, success", "long", "success"),
                                 ("short, success", "short", "success"),
                                 ("long, collapse", "long", "collapsed"),
                                 ("short, collapse", "short", "collapsed")]:
        values = rows.get(horizon, {})
        tests = {}
        for arm in CREDIT_ARMS:
            for base in BASELINES:
                x, y = strata(values, arm, base, key)
                if x:
                    d, p = stratified_permutation(x, y, draws=DRAWS, seed=PERMUTATION_SEED)
                    tests[f"{arm} - {base}"] = {"difference": d, "p": p, "strata": len(x)}
        adjusted = holm({k: t["p"] for k, t in tests.items()})
        out[family] = {k: {**t, "holm": adjusted[k]} for k, t in tests.items()}
    interaction = {}
    for arm in CREDIT_ARMS:
        parts = []
        for horizon in ("long", "short"):
            x, y = strata(rows.get(horizon, {}), arm, "grpo_merged", "success")
            if not x or any(len(v) < 2 for v in x + y):
                break
            parts.append(tost(x, y, MARGIN))
        if len(parts) == 2:
            d = parts[0]["difference"] - parts[1]["difference"]
            var = parts[0]["se"] ** 2 + parts[1]["se"] ** 2
            df = var**2 / (parts[0]["se"] ** 4 / parts[0]["df"] + parts[1]["se"] ** 4 /
                           parts[1]["df"]) if var else math.inf
            p = 2 * t_sf(abs(d) / math.sqrt(var), df) if var else float(d == 0)
            interaction[f"{arm} - grpo_merged"] = {"difference": d, "p": p, "df": df}
    adjusted = holm({k: t["p"] for k, t in interaction.items()})
    out["interaction"] = {k: {**t, "holm": adjusted[k]} for k, t in interaction.items()}
    for horizon in ("long", "short"):
        values = rows.get(horizon, {})
        tests = {}
        for arm in CREDIT_ARMS:
            for base in BASELINES:
                x, y = strata(values, arm, base, "success")
                if x and all(len(v) >= 2 for v in x + y):
                    tests[f"{arm} - {base}"] = tost(x, y, MARGIN)
        adjusted = holm({k: t["p"] for k, t in tests.items()})
        out[f"equivalence, {horizon}"] = {k: {**t, "holm": adjusted[k]}
                                         for k, t in tests.items()}
    return out


def report(args: argparse.Namespace, design: Design) -> str:
    results = args.results
    choice_path = results / "tuning-choice.json"
    if not choice_path.exists():
        raise SystemExit(f"no tuning-choice.json under {results}: the tuning stage has not "
                         "finished")
    chosen = {a: float(lr) for a, lr in json.loads(choice_path.read_text())["chosen"].items()}
    lines = [f"Progress: {progress(results, design)}.", "", "Warm starts (their own "
             "evaluation, held-out success [95 % CI]; bands " + ", ".join(
                 f"{h} {list(b)}" for h, b in BANDS.items()) + "):", "",
             "| horizon | seed | ε | SFT loss (last 10) | success | in band | used as |",
             "|---|---:|---:|---:|---|:-:|---|"]
    for horizon in design.horizons:
        seeds, _ = confirmation_warm_starts(results, horizon)
        for seed in range(0, MAX_CANDIDATES + 1):
            s = summary_of(results, Cell("warm-start", horizon, seed))
            if s is None:
                continue
            e = s["evaluation"]
            used = ("tuning" if seed == TUNING_WARM_START else
                    f"ws{seeds.index(seed) + 1}" if seed in seeds else "not used")
            lines.append(f"| {horizon} | {seed} | {s['demonstrator']['epsilon']:.3f} | "
                         f"{s['sft_loss']['last10_mean']:.3f} | {e['success']:.3f} "
                         f"[{e['success_ci95'][0]:.3f}, {e['success_ci95'][1]:.3f}] | "
                         f"{'yes' if s['in_band'] else 'no'} | {used} |")
    lines += ["", "Tuning (short horizon, seed-0 warm start): final held-out success, mean "
              "(runs); the rule's choice in bold.", "",
              "| arm | " + " | ".join(f"lr {lr:g}" for lr in design.lrs) + " |",
              "|---|" + "---:|" * len(design.lrs)]
    for arm in design.of(design.tuning_horizon)["arms"]:
        row = []
        for lr in design.lrs:
            v = [final_success(summary_of(results, c)) for c in tuning_cells(design)
                 if c.arm == arm and c.lr == lr and summary_of(results, c)]
            text = f"{sum(v) / len(v):.3f} ({len(v)})" if v else "no run"
            row.append(f"**{text}**" if v and chosen[arm] == lr else text)
        lines.append(f"| {ARMS[arm][0]} | " + " | ".join(row) + " |")
    rows = run_rows(results, design, chosen)
    tests = registered_tests(rows)
    for horizon in design.horizons:
        values = rows.get(horizon, {})
        lines += ["", f"**{horizon} horizon**: final held-out success, mean [95 % "
                  "t-interval] (runs); per warm start, mean; collapsed (final success "
                  f"more than {COLLAPSE_DROP} below the warm start's): count [95 % Wilson].",
                  "", "| arm | lr | runs | success | " + " | ".join(
                      f"ws{k}" for k in range(1, WARM_STARTS + 1)) + " | collapsed |",
                  "|---|---:|---:|---:|" + "---:|" * WARM_STARTS + "---:|"]
        for arm in design.of(horizon)["arms"]:
            runs = [r for ws in sorted(values.get(arm, {})) for r in values[arm][ws]]
            if not runs:
                continue
            mean, lo, hi = t_interval([r["success"] for r in runs])
            c = int(sum(r["collapsed"] for r in runs))
            rate, low, high = wilson(c, len(runs))
            per_ws = [f"{statistics.mean(r['success'] for r in values[arm][k]):.3f}"
                      if k in values[arm] else "—" for k in range(1, WARM_STARTS + 1)]
            lines.append(f"| {ARMS[arm][0]} | {chosen[arm]:g} | {len(runs)} | {mean:.3f} "
                         f"[{lo:.3f}, {hi:.3f}] | " + " | ".join(per_ws) +
                         f" | {c} = {rate:.2f} [{low:.2f}, {high:.2f}] |")
    for family, members in tests.items():
        if not members:
            continue
        lines += ["", f"Tests, {family} (two-sided; Holm within the family; significant "
                  f"if Holm p <= {ALPHA}" + (f"; equivalent if Holm p <= {ALPHA}, margin "
                                             f"±{MARGIN})" if "equivalence" in family
                                             else ")") + ":", "",
                  "| comparison | difference | p | p (Holm) |", "|---|---:|---:|---:|"]
        for name, t in members.items():
            extra = (f" [{t['low']:+.3f}, {t['high']:+.3f}]" if "low" in t else "")
            lines.append(f"| {name} | {t['difference']:+.3f}{extra} | {cf.p_text(t['p'])} "
                         f"| {cf.p_text(t['holm'])} |")
    lines += ["", "Every run: final held-out success.", "", "| cell | success |", "|---|---:|"]
    manifest = cf.read_manifest(results)
    for cell in tuning_cells(design) + confirmation_cells(design, chosen):
        s = summary_of(results, cell)
        if s is not None:
            lines.append(f"| {cell.id} | {final_success(s):.3f} |")
        elif st.failures(manifest, cell) >= MAX_ATTEMPTS:
            lines.append(f"| {cell.id} | missing ({MAX_ATTEMPTS} failed attempts) |")
    png = args.out.with_suffix(".png")
    plot(results, design, chosen, png)
    lines += ["", f"![confirmation runs: batch success per step]({png.name})", ""]
    return "\n".join(lines)


def plot(results: Path, design: Design, chosen: dict[str, float], out: Path) -> None:
    panels = []
    for horizon in design.horizons:
        curves = {}
        for arm in design.of(horizon)["arms"]:
            dirs = [results / c.id for c in confirmation_cells(design, chosen)
                    if c.horizon == horizon and c.arm == arm and summary_of(results, c)]
            curves[f"{ARMS[arm][0]} ({len(dirs)})"] = dirs
        panels.append((f"{horizon} horizon", "env/won", "batch success (mean, 95 % band)",
                       curves))
    cf.plot_panels(panels, out)


# --- the command line ------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "textworld-credit",
                        help="where runs work (not kept)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where finished cells and the manifest are kept (tracked)")
    parser.add_argument("--lock", type=Path, default=None,
                        help="a file locked (flock) around each cell")
    parser.add_argument("--one", action="store_true", help="the next cell only (3: done)")
    parser.add_argument("--status", action="store_true", help="counts per stage, no outcome")
    parser.add_argument("--report", action="store_true", help="the registered analysis")
    parser.add_argument("--out", type=Path, default=None, help="default: RUNS_DIR.md")
    smoke = parser.add_argument_group("pilot and smoke runs (need --results elsewhere)")
    smoke.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    smoke.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    smoke.add_argument("--tuning-seeds", nargs="+", type=int, default=list(TUNING_SEEDS))
    smoke.add_argument("--horizons", nargs="+", default=["short", "long"],
                       choices=["short", "long"])
    smoke.add_argument("--steps", type=int, nargs=2, metavar=("SHORT", "LONG"))
    smoke.add_argument("--runs", type=int, nargs=2, metavar=("SHORT", "LONG"))
    smoke.add_argument("--tuning-horizon", default="short", choices=["short", "long"])
    smoke.add_argument("--tuning-only", action="store_true",
                       help="stop once the tuning stage is done (a pilot)")
    args = parser.parse_args()
    args.out = args.out or args.runs_dir.with_suffix(".md")
    design = Design(tuple(args.lrs), tuple(args.tuning_seeds), tuple(args.horizons),
                    dict(zip(("short", "long"), args.steps)) if args.steps else None,
                    dict(zip(("short", "long"), args.runs)) if args.runs else None,
                    tuple(args.arms), args.tuning_horizon)
    if not design.registered and args.results.resolve() == RESULTS.resolve():
        parser.error("a design other than the registered one must keep its results "
                     "elsewhere: add --results DIR")
    if args.status:
        print(progress(args.results, design))
        return 0
    if args.report:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report(args, design))
        print(args.out.read_text())
        return 0
    check_design(args, design)

    def tuning_done(cell: Cell) -> bool:
        done = args.tuning_only and cell.stage != "tuning" and cell.ws != TUNING_WARM_START
        if done:
            print("tuning stage done (--tuning-only)")
        return done

    return st.run_cells(args, design, "experiments/textworld_credit.py", next_cell, progress,
                        run_one, stop=tuning_done)


if __name__ == "__main__":
    sys.exit(main())
