"""The confirmatory credit-assignment study (docs/study-credit-assignment.md): GRPO-OR,
MT-GRPO, GiGPO and turn-RTG x 32 seeds on ``configs/credit_assignment.yaml``, resumable.

    nohup python experiments/confirmatory.py --lock /tmp/lachesis-heavy.lock > runs/confirmatory.log 2>&1 &
    python experiments/confirmatory.py --cell gigpo 7   # one cell again, in runs/confirmatory-cells/
    python experiments/confirmatory.py --cell gigpo 7 --deterministic   # ... repeatable
    python experiments/confirmatory.py --report         # the registered tests, table and plot

The grid runs seeds outermost, in the registered arm order. A run works under
``RUNS_DIR`` (checkpoints, logs: not kept in git); when it finishes, its ``summary.json``
and ``trainer/metrics.jsonl`` are copied to ``RESULTS`` (``experiments/results/confirmatory``,
tracked), and a cell is finished when its copy exists there. Finished cells are skipped,
so stopping and starting again goes on where it stopped, on this machine or on a fresh
clone once the results are committed (an unfinished run is started again from scratch).
Every attempt appends one line to ``RESULTS/manifest.jsonl``: arm, seed, commit, dirty
tree, the warm start's weights hash, the full run config, start, seconds, outcome
(finished, failed with the error, or stopped). A cell that failed ``MAX_ATTEMPTS`` times
is left and reported as missing. The runs' settings come from
``experiments/credit_assignment.py``; the tests from ``experiments/stats.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))

import credit_assignment as ca  # noqa: E402
from stats import fisher_exact, holm, mann_whitney, t_interval, wilson  # noqa: E402

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import RunFailed, run_quietly  # noqa: E402

# arm -> (label, trainer settings, env settings), in the registered order
ARMS = {
    "grpo": ("GRPO-OR (outcome only)", {"estimator": "grpo"}, {}),
    "mt_grpo": ("MT-GRPO", {"estimator": "mt_grpo"}, {}),
    "gigpo": ("GiGPO (outcome only)", {"estimator": "gigpo"}, {"outcome_only": True}),
    "turn_rtg": ("turn-RTG", {"estimator": "turn_rtg"}, {}),
}
BASELINE = "grpo"
SEEDS = list(range(32))
RESULTS = REPO / "experiments" / "results" / "confirmatory"
# the warm start every registered run started from (weights, config, tokenizer), kept so
# that a fresh clone runs or repeats a cell from it rather than from a rebuilt one
WARM_START = RESULTS / "warm-start"
COLLAPSE_BELOW = 0.5  # final-evaluation tool success below this: collapsed
ALPHA = 0.05  # family-wise, per question, Holm over the comparisons with BASELINE
MAX_ATTEMPTS = 3
SECONDARY = {"tool_success": "tool success", "exact_match": "exact match",
             "direct_answer": "direct answers", "auc": "accuracy AUC"}


# --- the grid: what is finished, what is left --------------------------------------------

def read_manifest(results: Path) -> list[dict[str, Any]]:
    path = results / "manifest.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record(results: Path, entry: dict[str, Any]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    with open(results / "manifest.jsonl", "a") as f:
        f.write(json.dumps(entry, default=str) + "\n")


def is_finished(results: Path, arm: str, seed: int) -> bool:
    return (results / f"{arm}-seed{seed}" / "summary.json").exists()


def keep(run_dir: Path, results: Path, summary: dict[str, Any]) -> None:
    """A finished run's summary and per-step metrics into the tracked results; the
    summary last and by rename, so a cell is finished only once both are there."""
    cell = results / run_dir.name
    (cell / "trainer").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run_dir / "trainer" / "metrics.jsonl", cell / "trainer" / "metrics.jsonl")
    done = cell / "summary.json"
    done.with_suffix(".tmp").write_text(json.dumps(summary, indent=2, default=str))
    done.with_suffix(".tmp").rename(done)


def weights_hash(model: str) -> str:
    """sha256 over the warm start's weight files: the runs of one study share it (a
    fresh machine builds it again; the manifest shows whether it came out the same)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model).glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def study_warm_start(args: argparse.Namespace) -> str:
    """The study's warm start under ``RUNS_DIR``: the kept copy (``WARM_START``) when the
    runs have none yet, else built (and then reused) by the experiment's SFT."""
    final = args.runs_dir / "warm-start" / "warm_start" / "final"
    if not final.exists() and WARM_START.is_dir():
        shutil.copytree(WARM_START, final)
    return ca.warm_start(args)


def failures(manifest: list[dict[str, Any]], arm: str, seed: int) -> int:
    return sum(1 for e in manifest
               if e["arm"] == arm and e["seed"] == seed and e["outcome"] == "failed")


def pending(results: Path, arms: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """The cells still to run, seeds outermost: not finished and failed fewer than
    ``MAX_ATTEMPTS`` times (a stopped attempt does not count)."""
    manifest = read_manifest(results)
    return [(arm, seed) for seed in seeds for arm in arms
            if not is_finished(results, arm, seed)
            and failures(manifest, arm, seed) < MAX_ATTEMPTS]


def git_state(ignore: Path | None = None) -> dict[str, Any]:
    """The commit and whether the tree differs from it (``ignore``: a folder of the
    study's own results, written there as it goes, that does not count)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()

    inside = ignore is not None and ignore.resolve().is_relative_to(REPO)
    exclude = [f":(exclude){ignore.resolve().relative_to(REPO)}"] if inside else []
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", ".", *exclude))}


@contextlib.contextmanager
def held(lock: Path | None) -> Iterator[None]:
    """The shared heavy-work lock around one run (none: no lock)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_cell(args: argparse.Namespace, model: str, arm: str, seed: int, *,
             evaluate_before: bool) -> str:
    """One attempt at one cell, recorded in the manifest; returns its outcome."""
    config = ca.arm_config(args, model, arm, seed, arms=ARMS, evaluate_before=evaluate_before)
    if getattr(args, "deterministic", False):  # a cell again, synchronous and seeded
        config = RunConfig.model_validate({**config.model_dump(), "deterministic": True})
    entry = {"arm": arm, "seed": seed, **git_state(), "warm_start_sha256": weights_hash(model),
             "config": config.model_dump(mode="json"),
             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def run() -> dict[str, Any]:
        with held(args.lock):
            return run_quietly(config)

    return attempt(args.results, entry, run,
                   lambda summary: keep(config.run_dir, args.results, summary))


def attempt(results: Path, entry: dict[str, Any], run: Any, kept: Any) -> str:
    """One attempt: ``run()``, then ``kept(its result)`` (copies it into ``results``),
    then one manifest line with the outcome; returns the outcome. A ``RunFailed`` is
    recorded as failed; anything else that ends it (Ctrl-C, SIGTERM made an exception)
    is recorded as stopped and raised again: no result is kept, and the cell starts
    again from scratch next time. A run killed outright leaves no line at all."""
    started = time.monotonic()
    try:
        result = run()
    except RunFailed as error:
        record(results, {**entry, "outcome": "failed", "error": str(error),
                         "seconds": time.monotonic() - started})
        return "failed"
    except BaseException:
        record(results, {**entry, "outcome": "stopped", "seconds": time.monotonic() - started})
        raise
    kept(result)
    seconds = result.get("seconds", time.monotonic() - started)
    record(results, {**entry, "outcome": "finished", "seconds": seconds})
    return "finished"


def check_arms(args: argparse.Namespace) -> None:
    """Every arm's config is valid before any run starts (a misspelled setting stops the
    grid before its first run, not at the arm's first cell hours later)."""
    for arm in args.arms:
        try:
            ca.arm_config(args, "warm-start", arm, 0, arms=ARMS).check_sections()
        except ValueError as error:
            raise SystemExit(f"arm {arm}: {error}") from None


# --- the registered analysis ------------------------------------------------------------

def primary_tests(per_run: dict[tuple[str, int], dict[str, float]], arms: list[str],
                  baseline: str = BASELINE) -> dict[str, dict[str, dict[str, float]]]:
    """Per question, per arm against ``baseline``: raw and Holm-adjusted two-sided p."""
    def values(arm: str, key: str) -> list[float]:
        return [v[key] for (a, _), v in sorted(per_run.items()) if a == arm]

    def collapsed(arm: str) -> tuple[int, int]:
        runs = values(arm, "tool_success")
        return sum(v < COLLAPSE_BELOW for v in runs), len(runs)

    others = [arm for arm in arms if arm != baseline and values(arm, "correct")]
    c0, n0 = collapsed(baseline)
    collapse = {}
    for arm in others:
        c, n = collapsed(arm)
        collapse[arm] = fisher_exact(c, n - c, c0, n0 - c0)
    accuracy = {arm: mann_whitney(values(arm, "correct"), values(baseline, "correct"))[1]
                for arm in others}
    return {"collapse": {"p": collapse, "holm": holm(collapse)},
            "accuracy": {"p": accuracy, "holm": holm(accuracy)}}


def p_text(p: float) -> str:
    """A p-value to 4 decimals, or to 2 significant digits below 0.001 (not 0.0000)."""
    return f"{p:.4f}" if p >= 1e-3 else f"{p:.1e}"


def report(args: argparse.Namespace) -> str:
    # the finished runs' values, read from the tracked results
    args = argparse.Namespace(**{**vars(args), "runs_dir": args.results})
    per_run = {(arm, seed): ca.run_values(args, arm, seed, json.loads(
        (args.results / f"{arm}-seed{seed}" / "summary.json").read_text()))
        for seed in args.seeds for arm in args.arms if is_finished(args.results, arm, seed)}
    if BASELINE not in {arm for arm, _ in per_run}:
        raise SystemExit(f"no finished {BASELINE} run under {args.results}")
    manifest = read_manifest(args.results)
    missing = [(a, s) for s in args.seeds for a in args.arms if (a, s) not in per_run]
    tests = primary_tests(per_run, args.arms)
    lines = [(f"{len(per_run)} finished runs of {len(args.arms) * len(args.seeds)} "
              f"registered ({len(missing)} missing); {len(manifest)} attempts in the "
              "manifest."), "",
             (f"Primary endpoints. Collapse: final tool success < {COLLAPSE_BELOW}, count "
              "[95 % Wilson interval], Fisher's exact test against GRPO-OR. Final answer "
              "accuracy: mean [95 % t-interval], Mann-Whitney against GRPO-OR. Two-sided p, "
              f"Holm-adjusted over the comparisons; significant if <= {ALPHA}."), "",
             "| arm | runs | collapsed | p (Holm) | answer accuracy | p (Holm) |",
             "|---|---:|---:|---:|---:|---:|"]
    for arm in args.arms:
        runs = [v for (a, _), v in sorted(per_run.items()) if a == arm]
        if not runs:
            continue
        c = sum(r["tool_success"] < COLLAPSE_BELOW for r in runs)
        rate, low, high = wilson(c, len(runs))
        mean, lo, hi = t_interval([r["correct"] for r in runs])
        p = {q: "—" if arm == BASELINE else f"{p_text(t['p'][arm])} ({p_text(t['holm'][arm])})"
             for q, t in tests.items()}
        lines.append(f"| {ARMS[arm][0]} | {len(runs)} | {c} = {rate:.2f} [{low:.2f}, "
                     f"{high:.2f}] | {p['collapse']} | {mean:.3f} [{lo:.3f}, {hi:.3f}] | "
                     f"{p['accuracy']} |")
    lines += ["", "Secondary endpoints, mean [95 % t-interval]:", "",
              "| arm | " + " | ".join(SECONDARY.values()) + " |",
              "|---|" + "---:|" * len(SECONDARY)]
    for arm in args.arms:
        runs = [v for (a, _), v in sorted(per_run.items()) if a == arm]
        if runs:
            lines.append(f"| {ARMS[arm][0]} | " + " | ".join(
                "{:.3f} [{:.3f}, {:.3f}]".format(*t_interval([r[k] for r in runs]))
                for k in SECONDARY) + " |")
    if {"mt_grpo", "gigpo"} <= {arm for arm, _ in per_run}:
        pair = primary_tests(per_run, ["mt_grpo"], baseline="gigpo")
        lines += ["", ("Secondary, unadjusted: MT-GRPO against GiGPO, collapse (Fisher) "
                       f"p = {p_text(pair['collapse']['p']['mt_grpo'])}, answer accuracy "
                       f"(Mann-Whitney) p = {p_text(pair['accuracy']['p']['mt_grpo'])}.")]
    lines += ["", ("Every run: final tool success / answer accuracy / direct answers / "
                   "exact match / accuracy AUC."), "", "| arm | seed | values |", "|---|---:|---|"]
    lines += [f"| {arm} | {seed} | " + " / ".join(f"{v[k]:.3f}" for k in
              ["tool_success", "correct", "direct_answer", "exact_match", "auc"]) + " |"
              for (arm, seed), v in sorted(per_run.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    lines += [f"| {arm} | {seed} | missing ({failures(manifest, arm, seed)} failed attempts) |"
              for arm, seed in missing]
    png = args.out.with_suffix(".png")
    plot(args, sorted({arm for arm, _ in per_run}, key=list(ARMS).index), png)
    lines += ["", f"![batch tool success and answer accuracy per step]({png.name})", ""]
    return "\n".join(lines)


def step_bands(curves: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per step, over runs: mean and its 95 % t-interval (steps every run reached)."""
    n = min(len(c) for c in curves)
    rows = [t_interval([c[i] for c in curves]) for i in range(n)]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def plot(args: argparse.Namespace, arms: list[str], out: Path) -> None:
    plot_curves({ARMS[arm][0]: [args.results / f"{arm}-seed{s}" for s in args.seeds
                                if is_finished(args.results, arm, s)] for arm in arms}, out)


def plot_curves(runs: dict[str, list[Path]], out: Path) -> None:
    """Per label (an arm), batch tool success and answer accuracy per step over its runs'
    ``trainer/metrics.jsonl``: the mean and its 95 % band."""
    named = {f"{name} ({len(dirs)} runs)": dirs for name, dirs in runs.items()}
    plot_panels([(None, "env/tool_success", "batch tool success (mean, 95 % band)", named),
                 (None, "env/correct", "batch answer accuracy (mean, 95 % band)", named)],
                out, legend="first", alpha=0.15)


def plot_panels(panels: list[tuple[str | None, str, str, dict[str, list[Path]]]], out: Path,
                legend: str = "each", alpha: float = 0.12) -> None:
    """One panel per ``(title, metric, y label, {curve label: run dirs})``: per curve, the
    runs' ``metric`` per trainer step (their ``trainer/metrics.jsonl``, 0 where a step lacks
    it), the mean and its 95 % band (:func:`step_bands`); curves with no run are left out.
    ``legend``: on ``each`` panel or the ``first`` only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), dpi=120,
                             squeeze=False)
    for i, (ax, (title, key, ylabel, curves)) in enumerate(zip(axes[0], panels)):
        for name, dirs in curves.items():
            if not dirs:
                continue
            values = [[m.get(key, 0.0) for m in ca.read_metrics(d)] for d in dirs]
            mean, low, high = step_bands(values)
            steps = range(1, len(mean) + 1)
            line, = ax.plot(steps, mean, label=name)
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=alpha)
        if title:
            ax.set_title(title)
        ax.set_xlabel("trainer step")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if legend == "each" or i == 0:
            ax.legend(fontsize=7 if legend == "each" else 8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "credit_assignment.yaml")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                        help="default: the registered arms (fewer only for smoke runs)")
    parser.add_argument("--seeds", nargs="+", type=int, default=SEEDS,
                        help="default: the registered seeds 0..31")
    parser.add_argument("--steps", type=int, default=None, help="smoke runs only")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "confirmatory",
                        help="where runs work (checkpoints, logs)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where finished runs' summaries, metrics and the manifest are "
                        "kept (default: tracked in git)")
    parser.add_argument("--lock", type=Path, default=None,
                        help="a file locked (flock) around each run, e.g. /tmp/lachesis-heavy.lock")
    parser.add_argument("--cell", nargs=2, metavar=("ARM", "SEED"),
                        help="run this one cell again, from the study's warm start, into "
                        "RUNS_DIR-cells/ARM-seedSEED")
    parser.add_argument("--deterministic", action="store_true",
                        help="with --cell: run it synchronous and seeded, so that it repeats "
                        "exactly (docs/determinism.md; the registered grid is asynchronous), "
                        "into RUNS_DIR-cells-deterministic/")
    parser.add_argument("--report", action="store_true",
                        help="the registered tests, tables and plot from the finished runs")
    parser.add_argument("--out", type=Path, default=None, help="default: RUNS_DIR.md")
    args = parser.parse_args()
    args.out = args.out or args.runs_dir.with_suffix(".md")
    if args.deterministic and not args.cell:
        parser.error("--deterministic: only with --cell (the registered grid runs "
                     "asynchronously)")
    if args.cell:  # a cell again: beside the study, not in it
        args.runs_dir = args.runs_dir.with_name(
            args.runs_dir.name + ("-cells-deterministic" if args.deterministic else "-cells"))
        args.results = args.runs_dir
    if args.report:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report(args))
        print(args.out.read_text())
        return 0
    check_arms(args)
    with held(args.lock):
        model = study_warm_start(args)
    if args.cell:
        arm, seed = args.cell[0], int(args.cell[1])
        if arm not in ARMS:
            parser.error(f"--cell: unknown arm {arm!r}; the arms are {', '.join(ARMS)}")
        outcome = run_cell(args, model, arm, seed, evaluate_before=True)
        print(f"{arm} seed {seed}: {outcome}; {args.runs_dir / f'{arm}-seed{seed}'}")
        return 0 if outcome == "finished" else 1
    print("python experiments/confirmatory.py " + shlex.join(sys.argv[1:]), flush=True)
    while todo := pending(args.results, args.arms, args.seeds):
        arm, seed = todo[0]
        print(f"== {arm}, seed {seed} ({len(todo)} cells left)", flush=True)
        # the starting policy is measured once, by the grid's first cell
        first = (arm, seed) == (args.arms[0], args.seeds[0])
        print(f"   {run_cell(args, model, arm, seed, evaluate_before=first)}", flush=True)
        time.sleep(5)  # lets whoever waits on the lock in before the next cell
    print("grid done; `python experiments/confirmatory.py --report` writes the report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
