"""The stress study (docs/study-stress.md): GRPO-OR, MT-GRPO, GiGPO and turn-RTG, each at
its own tuned learning rate, across independently trained warm starts. Resumable.

    python experiments/stress.py --lock /tmp/lachesis-heavy.lock   # the grid, to the end
    python experiments/stress.py --one                             # the next cell, then exit
    python experiments/stress.py --status                          # counts only, no outcome
    python experiments/stress.py --report                          # the registered analysis

Cells, in the order they run:

1. ``warm-starts/ws0``: the tuning warm start (SFT, its own seeds).
2. ``tuning/lrLR/ARM-seedS``: every arm at every learning rate, tuning seeds outermost.
3. ``tuning-choice.json``: the registered rule picks each arm's learning rate, once every
   tuning cell is settled (finished, or failed ``MAX_ATTEMPTS`` times).
4. ``warm-starts/ws1..ws4``: the confirmation warm starts.
5. ``confirmation/wsK/ARM-seedS``: every arm at its chosen rate, 8 seeds per warm start;
   run index outermost, then warm start, then arm, so a study cut short stays balanced.

A run works under ``RUNS_DIR`` (not kept); a finished cell's files go to ``RESULTS``
(``experiments/results/stress``, tracked) and a cell is finished when its
``summary.json`` is there. Finished cells are skipped, so stopping and starting again, on
this machine or on a fresh clone of the committed results, goes on where it stopped; an
unfinished cell starts again from scratch. Every attempt appends a line to
``RESULTS/manifest.jsonl``: the cell, commit and dirty tree, the warm start's weights
hash, the hash of the interpreter's package list (the list itself in
``RESULTS/packages/HASH.txt``), the full config, start, seconds, outcome. The building
blocks (manifest, attempts, locks, plots) come from ``confirmatory.py``, the runs' settings
from ``credit_assignment.py``, the tests from ``stats.py``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))

import confirmatory as cf  # noqa: E402
import credit_assignment as ca  # noqa: E402
from stats import holm, stratified_permutation, t_interval, tost, wilson  # noqa: E402
from venv_pin import packages  # noqa: E402

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import Supervisor, run_quietly  # noqa: E402

ARMS = cf.ARMS  # the confirmatory study's four arms, in its order
BASELINE = "grpo"
LRS = [1e-4, 3e-4, 1e-3]
TUNING_SEEDS = [100, 101, 102, 103]
CONFIRMATION_WARM_STARTS = [1, 2, 3, 4]
RUNS_PER_WARM_START = 8
TUNING_WARM_START = 0
FALLBACK_LR = 3e-4  # an arm with no finished tuning run (the confirmatory study's rate)
RESULTS = REPO / "experiments" / "results" / "stress"
COLLAPSE_BELOW = cf.COLLAPSE_BELOW
ALPHA = 0.05  # family-wise, per family of three comparisons, Holm
MARGIN = 0.08  # equivalence margin on final answer accuracy (TOST)
DRAWS = 100_000  # random relabellings of the permutation test
PERMUTATION_SEED = 20261126
MAX_ATTEMPTS = cf.MAX_ATTEMPTS
MAX_BATCH_WAIT_S = 600  # an RL run with no trainable batch this long ends training early


def warm_start_seed(ws: int) -> int:
    """Warm start ``ws``'s seed: the tiny model's initialisation, the demonstration items
    and the SFT trainer (the confirmatory study's warm start used 0, 1 and 0)."""
    return 10 + ws


def confirmation_seed(ws: int, i: int) -> int:
    """The ``i``-th run of warm start ``ws`` (1..4): seeds 200..231, none used before."""
    return 200 + RUNS_PER_WARM_START * (ws - 1) + i


class Design(NamedTuple):
    arms: tuple[str, ...] = tuple(ARMS)
    lrs: tuple[float, ...] = tuple(LRS)
    tuning_seeds: tuple[int, ...] = tuple(TUNING_SEEDS)
    warm_starts: tuple[int, ...] = tuple(CONFIRMATION_WARM_STARTS)
    runs_per_warm_start: int = RUNS_PER_WARM_START

    @property
    def registered(self) -> bool:
        return self == Design()


class Cell(NamedTuple):
    stage: str  # warm-start, tuning, confirmation
    ws: int
    arm: str | None = None
    seed: int | None = None
    lr: float | None = None  # tuning: the cell's rate; confirmation: the arm's chosen one

    @property
    def id(self) -> str:
        if self.stage == "warm-start":
            return f"warm-starts/ws{self.ws}"
        if self.stage == "tuning":
            return f"tuning/lr{self.lr:g}/{self.arm}-seed{self.seed}"
        return f"confirmation/ws{self.ws}/{self.arm}-seed{self.seed}"

    @property
    def group(self) -> str:
        """The folder its runs share (``credit_assignment`` names a run ARM-seedS)."""
        return self.id.rsplit("/", 1)[0]


# --- the grid -----------------------------------------------------------------------------

def warm_start_cell(ws: int) -> Cell:
    return Cell("warm-start", ws)


def tuning_cells(design: Design) -> list[Cell]:
    return [Cell("tuning", TUNING_WARM_START, arm, seed, lr) for seed in design.tuning_seeds
            for lr in design.lrs for arm in design.arms]


def confirmation_cells(design: Design, chosen: dict[str, float]) -> list[Cell]:
    return [Cell("confirmation", ws, arm, confirmation_seed(ws, i), chosen[arm])
            for i in range(design.runs_per_warm_start) for ws in design.warm_starts
            for arm in design.arms]


def is_finished(results: Path, cell: Cell) -> bool:
    return (results / cell.id / "summary.json").exists()


def failures(manifest: list[dict[str, Any]], cell: Cell) -> int:
    return sum(1 for e in manifest if e["cell"] == cell.id and e["outcome"] == "failed")


def settled(results: Path, manifest: list[dict[str, Any]], cell: Cell) -> bool:
    return is_finished(results, cell) or failures(manifest, cell) >= MAX_ATTEMPTS


def final_accuracy(results: Path, cell: Cell) -> float:
    summary = json.loads((results / cell.id / "summary.json").read_text())
    return float(summary["after"][ca.ENV]["correct"])


def read_choice(results: Path) -> dict[str, Any] | None:
    """The learning rates the rule chose, once it has (else None)."""
    path = results / "tuning-choice.json"
    return json.loads(path.read_text()) if path.exists() else None


def choose(results: Path, design: Design) -> dict[str, Any]:
    """The registered rule: per arm, the learning rate with the best mean final answer
    accuracy over its finished tuning runs; equal means go to the smaller rate; an arm
    with no finished tuning run keeps ``FALLBACK_LR``. Written once to
    ``tuning-choice.json`` (only ``next_cell`` calls this, once every tuning cell is
    settled); once there it is read, never recomputed."""
    path = results / "tuning-choice.json"
    if (kept := read_choice(results)) is not None:
        return kept
    means: dict[str, dict[str, Any]] = {}
    chosen = {}
    for arm in design.arms:
        rows = {}
        for lr in sorted(design.lrs):
            values = [final_accuracy(results, c) for c in tuning_cells(design)
                      if c.arm == arm and c.lr == lr and is_finished(results, c)]
            if values:
                rows[lr] = sum(values) / len(values)
            means.setdefault(arm, {})[f"{lr:g}"] = {"runs": len(values), "mean": rows.get(lr)}
        if rows:
            best = max(rows.values())
            chosen[arm] = min(lr for lr, mean in rows.items() if mean >= best - 1e-12)
        else:
            chosen[arm] = FALLBACK_LR
    choice = {"rule": "best mean final answer accuracy over the tuning runs; ties to the "
                      "smaller rate", "chosen": chosen, "tuning": means,
              "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(choice, indent=2))
    tmp.rename(path)
    return choice


def next_cell(results: Path, design: Design) -> Cell | None:
    """The next cell to run, None when the grid is done. Makes the learning-rate choice
    (once) when every tuning cell is settled. A warm start that failed ``MAX_ATTEMPTS``
    times leaves its runs missing."""
    manifest = cf.read_manifest(results)
    tuning_start = warm_start_cell(TUNING_WARM_START)
    if not settled(results, manifest, tuning_start):
        return tuning_start
    if is_finished(results, tuning_start):
        for cell in tuning_cells(design):
            if not settled(results, manifest, cell):
                return cell
    chosen = {arm: float(lr) for arm, lr in choose(results, design)["chosen"].items()}
    for ws in design.warm_starts:
        if not settled(results, manifest, warm_start_cell(ws)):
            return warm_start_cell(ws)
    for cell in confirmation_cells(design, chosen):
        if is_finished(results, warm_start_cell(cell.ws)) and not settled(results, manifest, cell):
            return cell
    return None


def progress(results: Path, design: Design) -> str:
    """Counts per stage (no outcome of any run)."""
    manifest = cf.read_manifest(results)
    starts = [warm_start_cell(ws) for ws in (TUNING_WARM_START, *design.warm_starts)]
    confirmation = len(design.arms) * len(design.warm_starts) * design.runs_per_warm_start
    done = {stage: sum(1 for p in (results / folder).glob("**/summary.json"))
            if (results / folder).exists() else 0
            for stage, folder in [("warm-start", "warm-starts"), ("tuning", "tuning"),
                                  ("confirmation", "confirmation")]}
    outcomes = {o: sum(e["outcome"] == o for e in manifest) for o in ("failed", "stopped")}
    return (f"warm starts {done['warm-start']}/{len(starts)}, tuning "
            f"{done['tuning']}/{len(tuning_cells(design))}, confirmation "
            f"{done['confirmation']}/{confirmation}; {len(manifest)} attempts "
            f"({outcomes['failed']} failed, {outcomes['stopped']} stopped)")


# --- one cell -----------------------------------------------------------------------------

def entry_for(args: argparse.Namespace, cell: Cell) -> dict[str, Any]:
    text, digest = packages()
    listing = args.results / "packages" / f"{digest}.txt"
    if not listing.exists():
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text(text)
    return {"cell": cell.id, "stage": cell.stage, "warm_start": cell.ws, "arm": cell.arm,
            "seed": cell.seed, "lr": cell.lr, **cf.git_state(ignore=args.results),
            "packages_sha256": digest,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def cell_args(args: argparse.Namespace, cell: Cell) -> argparse.Namespace:
    """``credit_assignment``'s settings for the cell's runs (their own folder)."""
    return argparse.Namespace(**{**vars(args), "runs_dir": args.runs_dir / cell.group})


def warm_start_config(args: argparse.Namespace, ws: int) -> RunConfig:
    """The experiment's SFT warm start with warm start ``ws``'s own seeds: the tiny
    model's initialisation, the demonstration items, the SFT trainer."""
    seed = warm_start_seed(ws)
    values = ca.base_config(cell_args(args, warm_start_cell(ws)))
    values.update(name=f"ws{ws}", model=str(args.runs_dir / "warm-starts" / f"tiny-model-ws{ws}"),
                  build_tiny_model={**values["build_tiny_model"], "seed": seed})
    values["warm_start"]["settings"]["seed"] = seed
    values["warm_start"]["train"]["seed"] = seed
    if args.sft_steps:  # smoke runs only
        values["warm_start"]["train"].update(steps=args.sft_steps)
        values["warm_start"]["demonstrations"] = 32 * args.sft_steps
    return RunConfig.model_validate(values)


def train_warm_start(config: RunConfig) -> dict[str, Any]:
    """SFT from scratch (an earlier attempt's files removed); the final weights' path."""
    for stale in (config.run_dir, Path(config.model)):
        if stale.exists():
            shutil.rmtree(stale)
    config.run_dir.mkdir(parents=True)
    started = time.monotonic()
    supervisor = Supervisor(config, live=False)
    try:
        final = supervisor.prepare_model()
    finally:
        supervisor.stop_all()
    return {"final": final, "seconds": time.monotonic() - started}


def keep_warm_start(results: Path, cell: Cell, config: RunConfig, trained: dict[str, Any]) -> None:
    """The weights, config and tokenizer (not the optimizer state) into ``results``; the
    summary last, by rename."""
    kept = results / cell.id
    if kept.exists():
        shutil.rmtree(kept)
    shutil.copytree(trained["final"], kept, ignore=shutil.ignore_patterns("trainer_state.pt"))
    summary = {"warm_start": cell.ws, "seed": warm_start_seed(cell.ws),
               "sha256": cf.weights_hash(str(kept)), "seconds": trained["seconds"],
               "config": config.model_dump(mode="json")}
    done = kept / "summary.json"
    done.with_suffix(".tmp").write_text(json.dumps(summary, indent=2, default=str))
    done.with_suffix(".tmp").rename(done)


def warm_start_model(args: argparse.Namespace, ws: int) -> tuple[str, str]:
    """Warm start ``ws``'s kept weights, copied under ``RUNS_DIR`` (runs do not read from
    the tracked copy), and their hash, checked against the one recorded when it was made."""
    kept = args.results / warm_start_cell(ws).id
    recorded = json.loads((kept / "summary.json").read_text())["sha256"]
    model = args.runs_dir / "warm-starts" / f"ws{ws}-model"
    if not model.exists() or cf.weights_hash(str(model)) != recorded:
        if model.exists():
            shutil.rmtree(model)
        shutil.copytree(kept, model, ignore=shutil.ignore_patterns("summary.json"))
    digest = cf.weights_hash(str(model))
    if digest != recorded:
        raise SystemExit(f"warm start ws{ws}: weights hash {digest[:12]} is not the recorded "
                         f"{recorded[:12]} ({kept})")
    return str(model), digest


def first_of_warm_start(design: Design, cell: Cell) -> bool:
    """The first RL cell of each warm start also evaluates the starting policy."""
    if cell.stage == "tuning":
        return cell == tuning_cells(design)[0]
    return cell.seed == confirmation_seed(cell.ws, 0) and cell.arm == design.arms[0]


def rl_config(args: argparse.Namespace, design: Design, cell: Cell, model: str) -> RunConfig:
    config = ca.arm_config(cell_args(args, cell), model, cell.arm, cell.seed, arms=ARMS,
                           evaluate_before=first_of_warm_start(design, cell))
    values = config.model_dump()
    values["train"]["lr"] = cell.lr
    # A run whose every group scores equal gets no batch (the env drops such groups): its
    # training ends after this long without one, and the run evaluates as usual.
    values["train"]["max_batch_wait_s"] = MAX_BATCH_WAIT_S
    return RunConfig.model_validate(values)


def run_one(args: argparse.Namespace, design: Design, cell: Cell) -> str:
    """One attempt at ``cell``, recorded in the manifest; its outcome."""
    if cell.stage == "warm-start":
        config = warm_start_config(args, cell.ws)
        entry = {**entry_for(args, cell), "config": config.model_dump(mode="json")}
        return cf.attempt(args.results, entry, lambda: train_warm_start(config),
                          lambda trained: keep_warm_start(args.results, cell, config, trained))
    model, digest = warm_start_model(args, cell.ws)
    config = rl_config(args, design, cell, model)
    entry = {**entry_for(args, cell), "warm_start_sha256": digest,
             "config": config.model_dump(mode="json")}

    def kept(summary: dict[str, Any]) -> None:
        cf.keep(config.run_dir, args.results / cell.group, summary)

    return cf.attempt(args.results, entry, lambda: run_quietly(config), kept)


def check_design(args: argparse.Namespace, design: Design) -> None:
    """Every config the grid will make is valid before anything runs."""
    try:
        warm_start_config(args, TUNING_WARM_START).check_sections()
        for arm in design.arms:
            for lr in design.lrs:
                rl_config(args, design, Cell("tuning", 0, arm, 0, lr), "warm-start").check_sections()
    except ValueError as error:
        raise SystemExit(f"stress study: {error}") from None


# --- the registered analysis ----------------------------------------------------------------

def stalled(results: Path, cell: Cell) -> dict[str, Any] | None:
    """A finished run whose training stopped early (no trainable batch for
    ``MAX_BATCH_WAIT_S``): its record (``step``, ``steps``, ``waited_s``); else None."""
    return json.loads((results / cell.id / "summary.json").read_text()).get("stopped_early")


def stalled_table(results: Path, cells: list[Cell], arms: tuple[str, ...], columns: list[Any],
                  column_of: Any, label: Any) -> list[str]:
    """Markdown: per arm and column, the finished runs that stalled, ``k of n``."""
    lines = ["| arm | " + " | ".join(label(c) for c in columns) + " | all |",
             "|---|" + "---:|" * (len(columns) + 1)]
    for arm in arms:
        finished = [c for c in cells if c.arm == arm and is_finished(results, c)]
        row = []
        for column in [*columns, None]:
            runs = [c for c in finished if column is None or column_of(c) == column]
            row.append(f"{sum(stalled(results, c) is not None for c in runs)} of {len(runs)}")
        lines.append(f"| {ARMS[arm][0]} | " + " | ".join(row) + " |")
    runs = [(c, stalled(results, c)) for c in cells if is_finished(results, c)]
    named = [f"{c.id} (step {s['step']} of {s['steps']})" for c, s in runs if s is not None]
    return lines + ["", "Stalled: " + ("; ".join(named) if named else "none") + "."]


def confirmation_values(results: Path, design: Design, *, without_stalled: bool = False
                        ) -> dict[str, dict[int, list[dict[str, float]]]]:
    """arm -> warm start -> the finished confirmation runs' final values (and AUC)
    (``without_stalled``: leaving out the runs whose training stopped early)."""
    chosen = read_choice(results)["chosen"]
    values: dict[str, dict[int, list[dict[str, float]]]] = {}
    for cell in confirmation_cells(design, chosen):
        if is_finished(results, cell) and not (without_stalled and stalled(results, cell)):
            summary = json.loads((results / cell.id / "summary.json").read_text())
            run = ca.run_values(argparse.Namespace(runs_dir=results / cell.group),
                                cell.arm, cell.seed, summary)
            values.setdefault(cell.arm, {}).setdefault(cell.ws, []).append(run)
    return values


def by_stratum(values: dict[str, dict[int, list[dict[str, float]]]], arm: str, other: str,
               key: str, min_runs: int = 1) -> tuple[list[list[float]], list[list[float]]]:
    """The two arms' values of ``key`` per warm start, over the warm starts where both
    have at least ``min_runs`` runs."""
    shared = sorted(ws for ws in set(values.get(arm, {})) & set(values.get(other, {}))
                    if min(len(values[arm][ws]), len(values[other][ws])) >= min_runs)
    if key == "collapsed":
        def pick(r: dict[str, float]) -> float:
            return float(r["tool_success"] < COLLAPSE_BELOW)
    else:
        def pick(r: dict[str, float]) -> float:
            return r[key]
    return ([[pick(r) for r in values[arm][ws]] for ws in shared],
            [[pick(r) for r in values[other][ws]] for ws in shared])


def registered_tests(values: dict[str, dict[int, list[dict[str, float]]]],
                     arms: list[str]) -> dict[str, Any]:
    """Primary: final answer accuracy, each arm against GRPO-OR, permutation test
    stratified by warm start, Holm over the three. Secondary: collapse, the same test on
    collapse indicators, Holm over the three. Equivalence (TOST, margin ``MARGIN``):
    each arm against GRPO-OR, and each pair of the other arms; Holm within each family."""
    others = [arm for arm in arms if arm != BASELINE and arm in values]
    out: dict[str, Any] = {}
    for name, key in [("accuracy", "correct"), ("collapse", "collapsed")]:
        rows = {arm: stratified_permutation(*by_stratum(values, arm, BASELINE, key),
                                            draws=DRAWS, seed=PERMUTATION_SEED)
                for arm in others if BASELINE in values}
        p = {arm: r[1] for arm, r in rows.items()}
        out[name] = {"difference": {arm: r[0] for arm, r in rows.items()}, "p": p,
                     "holm": holm(p)}
    pairs = {"against GRPO-OR": [(arm, BASELINE) for arm in others if BASELINE in values],
             "between the other arms": [(a, b) for i, a in enumerate(others)
                                        for b in others[i + 1:]]}
    for family, members in pairs.items():
        rows = {f"{a} - {b}": tost(*by_stratum(values, a, b, "correct", min_runs=2), MARGIN)
                for a, b in members}
        adjusted = holm({k: r["p"] for k, r in rows.items()})
        out[f"equivalence {family}"] = {k: {**r, "holm": adjusted[k]} for k, r in rows.items()}
    return out


def report(args: argparse.Namespace, design: Design) -> str:
    from confirmatory import p_text

    results = args.results
    manifest = cf.read_manifest(results)
    choice = read_choice(results)
    if choice is None:
        raise SystemExit(f"the tuning stage has not finished under {results}: no "
                         "tuning-choice.json (the registered analysis waits for the grid)")
    lines = [f"Progress: {progress(results, design)}.", "",
             "Warm starts (final-evaluation values of the first run from each, before RL):", "",
             "| warm start | seed | weights sha256 | tool success | answer accuracy | direct answers |",
             "|---|---:|---|---:|---:|---:|"]
    firsts = [c for c in tuning_cells(design)[:1]] + [
        c for c in confirmation_cells(design, choice["chosen"]) if first_of_warm_start(design, c)]
    for ws in (TUNING_WARM_START, *design.warm_starts):
        kept = results / warm_start_cell(ws).id / "summary.json"
        if not kept.exists():
            lines.append(f"| ws{ws} | {warm_start_seed(ws)} | missing | | | |")
            continue
        sha = json.loads(kept.read_text())["sha256"][:12]
        first = next((c for c in firsts if c.ws == ws and is_finished(results, c)), None)
        before = (json.loads((results / first.id / "summary.json").read_text())
                  .get("before", {}).get(ca.ENV) if first else None)
        cells = (" | ".join(f"{before.get(k, 0.0):.3f}" for k in
                            ("tool_success", "correct", "direct_answer")) if before else "| |")
        lines.append(f"| ws{ws} | {warm_start_seed(ws)} | `{sha}…` | {cells} |")
    lines += ["", "Tuning (warm start ws0): final answer accuracy, mean [95 % t-interval], "
              "runs, collapsed; the rule's choice in bold.", "",
              "| arm | " + " | ".join(f"lr {lr:g}" for lr in design.lrs) + " |",
              "|---|" + "---:|" * len(design.lrs)]
    for arm in design.arms:
        row = []
        for lr in design.lrs:
            cells = [c for c in tuning_cells(design) if c.arm == arm and c.lr == lr
                     and is_finished(results, c)]
            if not cells:
                row.append("no run")
                continue
            runs = [json.loads((results / c.id / "summary.json").read_text())["after"][ca.ENV]
                    for c in cells]
            mean, lo, hi = t_interval([r["correct"] for r in runs])
            text = (f"{mean:.3f} [{lo:.3f}, {hi:.3f}], {len(runs)} runs, "
                    f"{sum(r['tool_success'] < COLLAPSE_BELOW for r in runs)} collapsed")
            row.append(f"**{text}**" if float(choice["chosen"][arm]) == lr else text)
        lines.append(f"| {ARMS[arm][0]} | " + " | ".join(row) + " |")
    lines += ["", f"Tuning runs that stalled (training stopped early: no trainable batch for "
              f"{MAX_BATCH_WAIT_S} s; evaluated on their last weights), of the finished runs:",
              "", *stalled_table(results, tuning_cells(design), design.arms, list(design.lrs),
                                 lambda c: c.lr, lambda lr: f"lr {lr:g}")]
    values = confirmation_values(results, design)
    if BASELINE not in values:
        return "\n".join(lines + ["", f"No finished {BASELINE} confirmation run yet."])
    tests = registered_tests(values, list(design.arms))
    lines += ["", (f"Confirmation: {sum(len(v) for a in values.values() for v in a.values())} "
                   "finished runs. Final answer accuracy: mean [95 % t-interval] over all runs; "
                   "difference from GRPO-OR: the mean over warm starts of the within-warm-start "
                   "difference; p: permutation test stratified by warm start, two-sided "
                   f"({DRAWS} relabellings), Holm over the three; significant if <= {ALPHA}. "
                   f"Collapse (secondary): final tool success < {COLLAPSE_BELOW}, count "
                   "[95 % Wilson interval], the same test on the collapse indicators."), "",
              "| arm | lr | runs | answer accuracy | difference | p (Holm) | collapsed | "
              "difference | p (Holm) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in design.arms:
        runs = [r for ws in sorted(values.get(arm, {})) for r in values[arm][ws]]
        if not runs:
            continue
        mean, lo, hi = t_interval([r["correct"] for r in runs])
        c = sum(r["tool_success"] < COLLAPSE_BELOW for r in runs)
        rate, low, high = wilson(c, len(runs))
        cells = []
        for name in ("accuracy", "collapse"):
            t = tests[name]
            cells.append("— | —" if arm == BASELINE else
                         f"{t['difference'][arm]:+.3f} | {p_text(t['p'][arm])} "
                         f"({p_text(t['holm'][arm])})")
        lines.append(f"| {ARMS[arm][0]} | {float(choice['chosen'][arm]):g} | {len(runs)} | "
                     f"{mean:.3f} [{lo:.3f}, {hi:.3f}] | {cells[0]} | {c} = {rate:.2f} "
                     f"[{low:.2f}, {high:.2f}] | {cells[1]} |")
    lines += ["", f"Confirmation runs that stalled (training stopped early: no trainable "
              f"batch for {MAX_BATCH_WAIT_S} s; evaluated on their last weights), of the "
              "finished runs:", "",
              *stalled_table(results, confirmation_cells(design, choice["chosen"]),
                             design.arms, list(design.warm_starts), lambda c: c.ws,
                             lambda ws: f"ws{ws}")]
    kept = confirmation_values(results, design, without_stalled=True)
    left_out = (sum(len(v) for a in values.values() for v in a.values())
                - sum(len(v) for a in kept.values() for v in a.values()))
    if not left_out:
        lines += ["", "Sensitivity: no confirmation run stalled; the primary test stands as "
                  "it is."]
    elif BASELINE not in kept:
        lines += ["", f"Sensitivity: without the {left_out} stalled runs no {BASELINE} run "
                  "is left; the primary test cannot be repeated."]
    else:
        again = registered_tests(kept, list(design.arms))["accuracy"]
        lines += ["", f"Sensitivity (not registered): the primary test without the {left_out} "
                  "stalled runs: " + "; ".join(
                      f"{ARMS[arm][0]} {again['difference'][arm]:+.3f}, p "
                      f"{p_text(again['p'][arm])} (Holm {p_text(again['holm'][arm])})"
                      for arm in design.arms if arm in again["p"]) + "."]
    lines += ["", (f"Equivalence (TOST, margin ±{MARGIN} accuracy; shown when Holm p <= "
                   f"{ALPHA}, i.e. the 90 % interval inside the margin at the unadjusted level):"),
              "", "| family | difference | stratified difference [90 % interval] | df | p | "
              "p (Holm) |", "|---|---|---:|---:|---:|---:|"]
    for family in ("against GRPO-OR", "between the other arms"):
        for pair, r in tests[f"equivalence {family}"].items():
            lines.append(f"| {family} | {pair} | {r['difference']:+.3f} [{r['low']:+.3f}, "
                         f"{r['high']:+.3f}] | {r['df']:.1f} | {p_text(r['p'])} | "
                         f"{p_text(r['holm'])} |")
    lines += ["", "Per warm start, final answer accuracy, mean (runs):", "",
              "| arm | " + " | ".join(f"ws{ws}" for ws in design.warm_starts) + " |",
              "|---|" + "---:|" * len(design.warm_starts)]
    for arm in design.arms:
        lines.append(f"| {ARMS[arm][0]} | " + " | ".join(
            f"{sum(r['correct'] for r in values[arm][ws]) / len(values[arm][ws]):.3f} "
            f"({len(values[arm][ws])})" if ws in values.get(arm, {}) else "—"
            for ws in design.warm_starts) + " |")
    lines += ["", "Every run: final tool success / answer accuracy / direct answers / exact "
              "match / accuracy AUC.", "", "| cell | values |", "|---|---|"]
    every = tuning_cells(design) + confirmation_cells(design, choice["chosen"])
    for cell in every:
        if is_finished(results, cell):
            summary = json.loads((results / cell.id / "summary.json").read_text())
            v = ca.run_values(argparse.Namespace(runs_dir=results / cell.group), cell.arm,
                              cell.seed, summary)
            lines.append(f"| {cell.id} | " + " / ".join(f"{v[k]:.3f}" for k in
                         ["tool_success", "correct", "direct_answer", "exact_match", "auc"]) + " |")
        elif settled(results, manifest, cell):
            lines.append(f"| {cell.id} | missing ({failures(manifest, cell)} failed attempts) |")
    png = args.out.with_suffix(".png")
    cf.plot_curves({f"{ARMS[arm][0]} at lr {float(choice['chosen'][arm]):g}":
                    [results / c.id for c in confirmation_cells(design, choice["chosen"])
                     if c.arm == arm and is_finished(results, c)] for arm in design.arms}, png)
    lines += ["", f"![confirmation runs: batch tool success and answer accuracy per step]"
              f"({png.name})", ""]
    return "\n".join(lines)


# --- the command line ------------------------------------------------------------------------

def stop_on_sigterm() -> None:
    """SIGTERM ends a run like Ctrl-C: its processes are stopped, the attempt recorded."""
    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, raise_interrupt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "credit_assignment.yaml")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "stress",
                        help="where runs work (checkpoints, logs; not kept)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where finished cells and the manifest are kept (default: "
                        "tracked in git)")
    parser.add_argument("--lock", type=Path, default=None,
                        help="a file locked (flock) around each cell, e.g. "
                        "/tmp/lachesis-heavy.lock (leave out when the caller holds it)")
    parser.add_argument("--one", action="store_true",
                        help="run the next cell only, then exit (0: ran it, 3: grid done)")
    parser.add_argument("--status", action="store_true", help="counts per stage, no outcome")
    parser.add_argument("--report", action="store_true",
                        help="the registered analysis (only at the registered analysis point)")
    parser.add_argument("--out", type=Path, default=None, help="default: RUNS_DIR.md")
    smoke = parser.add_argument_group("smoke runs (need --results elsewhere)")
    smoke.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    smoke.add_argument("--lrs", nargs="+", type=float, default=LRS)
    smoke.add_argument("--tuning-seeds", nargs="+", type=int, default=TUNING_SEEDS)
    smoke.add_argument("--warm-starts", nargs="+", type=int, default=CONFIRMATION_WARM_STARTS)
    smoke.add_argument("--runs-per-warm-start", type=int, default=RUNS_PER_WARM_START)
    smoke.add_argument("--steps", type=int, default=None, help="RL steps per run")
    smoke.add_argument("--sft-steps", type=int, default=None, help="SFT steps per warm start")
    args = parser.parse_args()
    args.out = args.out or args.runs_dir.with_suffix(".md")
    design = Design(tuple(args.arms), tuple(args.lrs), tuple(args.tuning_seeds),
                    tuple(args.warm_starts), args.runs_per_warm_start)
    changed = not design.registered or args.steps or args.sft_steps
    if changed and args.results.resolve() == RESULTS.resolve():
        parser.error("a design other than the registered one (--arms, --lrs, --tuning-seeds, "
                     "--warm-starts, --runs-per-warm-start, --steps, --sft-steps) must keep "
                     "its results elsewhere: add --results DIR")
    if TUNING_WARM_START in design.warm_starts:
        parser.error(f"--warm-starts: ws{TUNING_WARM_START} is the tuning warm start")
    if args.status:
        print(progress(args.results, design))
        return 0
    if args.report:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report(args, design))
        print(args.out.read_text())
        return 0
    check_design(args, design)
    return run_cells(args, design, "experiments/stress.py", next_cell, progress, run_one)


def run_cells(args: argparse.Namespace, design: Any, script: str, next_cell: Any,
              progress: Any, run_one: Any, stop: Any = None) -> int:
    """A study's grid, cell after cell, each under ``args.lock``: the next cell's name
    and the counts (no outcome), its outcome; ``args.one``: one cell (3: the grid is
    done). ``stop(cell)``: end before that cell (0)."""
    stop_on_sigterm()
    print(f"python {script} " + shlex.join(sys.argv[1:]), flush=True)
    while (cell := next_cell(args.results, design)) is not None:
        if stop is not None and stop(cell):
            return 0
        # the cell's name only (a confirmation cell's name has no learning rate in it)
        print(f"== {cell.id} ({progress(args.results, design)})", flush=True)
        with cf.held(args.lock):
            outcome = run_one(args, design, cell)
        print(f"   {outcome}", flush=True)
        if args.one:
            return 0
        time.sleep(5)  # lets whoever waits on the lock in before the next cell
    print(f"grid done; `python {script} --report` runs the registered analysis")
    return 3 if args.one else 0


if __name__ == "__main__":
    sys.exit(main())
