"""Credit assignment on ``arithmetic_tool``: GRPO-OR, GRPO-MR, MT-GRPO, turn-RTG and
turn-prefix samples from one warm start, with the same seeds and the same budget.

    python experiments/credit_assignment.py                 # the pre-registered 5 arms x 5 seeds
    python experiments/credit_assignment.py --arms grpo mt_grpo --seeds 0 --steps 5  # a smoke run
    python experiments/credit_assignment.py --report-only   # report the runs that finished

The setting, arms, metrics and analysis are fixed in ``configs/credit_assignment.yaml`` and
pre-registered in docs/results.md. Every run is a real ``lachesis run`` (rollout API,
vLLM, env server, trainer as processes) from one shared SFT warm start; the arm and the
seed are the only differences. Per arm, over seeds: the final evaluation's tool success,
exact match, answer accuracy and direct-answer rate, and the area under the training
accuracy curve (the mean of the batches' answer accuracy over all RL steps), each as a mean
with its 95 % t-interval over seeds, and each arm's paired difference from GRPO-OR (same
seeds, same items). The report goes to ``runs/credit_assignment.md`` (``--out``), the plot
beside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import RunFailed, Supervisor, run_quietly  # noqa: E402

sys.path.insert(0, str(REPO / "experiments"))
from stats import t_interval  # noqa: E402

ENV = "arithmetic_tool"
# arm -> (label, trainer settings)
ARMS = {
    "grpo": ("GRPO-OR (outcome)", {"estimator": "grpo"}),
    "grpo_merged": ("GRPO-MR (summed turns)", {"estimator": "grpo_merged"}),
    "mt_grpo": ("MT-GRPO", {"estimator": "mt_grpo"}),
    "turn_rtg": ("turn-RTG", {"estimator": "turn_rtg"}),
    # One row per turn prefix, each weighted as a sequence: under token_mean the rows
    # would give exactly the gradient of one row per trajectory (docs/training.md).
    "turn_prefix": ("turn-prefix samples (turn-RTG)",
                    {"estimator": "turn_rtg", "samples": "turn_prefix",
                     "aggregation": "sequence_mean"}),
}
# final-evaluation metric -> label; "auc" is the area under the training accuracy curve
METRICS = {"tool_success": "tool success", "exact_match": "exact match",
           "correct": "answer accuracy", "direct_answer": "direct answers",
           "auc": "accuracy AUC"}
def base_config(args: argparse.Namespace) -> dict[str, Any]:
    config = yaml.safe_load(args.config.read_text())
    config["runs_dir"] = str(args.runs_dir)
    if config.get("build_tiny_model"):  # built once, under this experiment's runs
        config["model"] = str(args.runs_dir / "tiny-model")
    if args.steps:
        config["train"].update(steps=args.steps, checkpoint_every=args.steps)
    return config


def warm_start(args: argparse.Namespace) -> str:
    """One SFT warm start shared by every run (reused when it exists)."""
    config = RunConfig.model_validate({**base_config(args), "name": "warm-start"})
    config.run_dir.mkdir(parents=True, exist_ok=True)
    return Supervisor(config, live=False).prepare_model()


def arm_config(args: argparse.Namespace, model: str, arm: str, seed: int, *,
               evaluate_before: bool = True, arms: dict[str, tuple] = ARMS) -> RunConfig:
    """One run of the experiment: the config's settings with the arm's and the seed's.
    An arm is ``(label, trainer settings)`` or ``(label, trainer settings, env settings)``."""
    values = base_config(args)
    values.update(name=f"{arm}-seed{seed}", model=model, warm_start=None,
                  build_tiny_model=False, evaluate_before=evaluate_before)
    values["train"].update(**arms[arm][1], seed=seed)
    values["envs"][0]["settings"].update(arms[arm][2] if len(arms[arm]) > 2 else {})
    values["envs"][0]["settings"]["seed"] = 1000 + seed  # the same items for every arm
    return RunConfig.model_validate(values)


def one_run(args: argparse.Namespace, model: str, arm: str, seed: int, *,
            evaluate_before: bool) -> dict[str, Any]:
    name = f"{arm}-seed{seed}"
    run_dir = args.runs_dir / name
    if (run_dir / "summary.json").exists():  # finished earlier: reuse
        return json.loads((run_dir / "summary.json").read_text())
    summary = run_quietly(arm_config(args, model, arm, seed, evaluate_before=evaluate_before))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "trainer" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_values(args: argparse.Namespace, arm: str, seed: int,
               summary: dict[str, Any]) -> dict[str, float]:
    after = summary["after"][ENV]
    values = {key: float(after.get(key, 0.0)) for key in METRICS if key != "auc"}
    curve = [m["env/correct"] for m in read_metrics(args.runs_dir / f"{arm}-seed{seed}")
             if "env/correct" in m]
    values["auc"] = statistics.mean(curve) if curve else 0.0
    return values


def cell(values: list[float]) -> str:
    mean, low, high = t_interval(values)
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def report(args: argparse.Namespace, results: dict[tuple[str, int], dict[str, Any]],
           command: str, minutes: float) -> str:
    before = next(r["before"][ENV] for r in results.values() if "before" in r)
    per_run = {key: run_values(args, *key, summary) for key, summary in results.items()}
    seeds = sorted({seed for _, seed in results})
    lines = [
        f"Command: `{command}` ({len(results)} runs, {minutes:.0f} minutes of RL runs on "
        "this 2-core machine).", "",
        f"Warm start, before RL ({before['items']} held-out items): tool success "
        f"{before['tool_success']:.3f}, exact match {before['exact_match']:.3f}, answer "
        f"accuracy {before['correct']:.3f}, direct answers {before.get('direct_answer', 0):.3f}.",
        "", "Mean over seeds [95 % t-interval]; final evaluation except accuracy AUC "
        "(the mean batch answer accuracy over all RL steps).", "",
        "| arm | seeds | " + " | ".join(METRICS.values()) + " |",
        "|---|---:|" + "---:|" * len(METRICS)]
    for arm in args.arms:
        runs = [per_run[(arm, s)] for s in seeds if (arm, s) in per_run]
        if runs:
            lines.append(f"| {ARMS[arm][0]} | {len(runs)} | "
                         + " | ".join(cell([r[k] for r in runs]) for k in METRICS) + " |")
    lines += ["", "Paired difference from GRPO-OR (same seeds), mean [95 % t-interval]:", "",
              "| arm | " + " | ".join(METRICS.values()) + " |", "|---|" + "---:|" * len(METRICS)]
    for arm in args.arms:
        paired = [s for s in seeds if (arm, s) in per_run and ("grpo", s) in per_run]
        if arm == "grpo" or not paired:
            continue
        lines.append(f"| {ARMS[arm][0]} | " + " | ".join(
            cell([per_run[(arm, s)][k] - per_run[("grpo", s)][k] for s in paired])
            for k in METRICS) + " |")
    plot(args, [arm for arm in args.arms if any((arm, s) in results for s in seeds)], seeds,
         args.out.with_suffix(".png"))
    lines += ["", f"![batch tool success and accuracy during RL]({args.out.with_suffix('.png').name})", ""]
    return "\n".join(lines)


def plot(args: argparse.Namespace, arms: list[str], seeds: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for ax, key, label in zip(axes, ["env/tool_success", "env/correct"],
                              ["tool success", "answer accuracy"]):
        for arm in arms:
            runs = [[m.get(key, 0.0) for m in read_metrics(args.runs_dir / f"{arm}-seed{s}")]
                    for s in seeds if (args.runs_dir / f"{arm}-seed{s}" / "summary.json").exists()]
            n = min(len(r) for r in runs)
            mean = [statistics.mean(r[i] for r in runs) for i in range(n)]
            smooth = [statistics.mean(mean[max(0, i - 4):i + 1]) for i in range(n)]
            ax.plot(range(1, n + 1), smooth, label=ARMS[arm][0])
        ax.set_xlabel("trainer step")
        ax.set_ylabel(f"batch {label} (mean over seeds, 5-step average)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "credit_assignment.yaml")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps per run (default: the config's; for smoke runs)")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="default: the config's runs_dir")
    parser.add_argument("--out", type=Path, default=None,
                        help="the report (default: RUNS_DIR.md; copy what you want to keep "
                        "into docs/results.md)")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report from the runs that finished; start none")
    args = parser.parse_args()
    if args.runs_dir is None:
        args.runs_dir = REPO / yaml.safe_load(args.config.read_text())["runs_dir"]
    args.out = args.out or args.runs_dir.with_suffix(".md")
    command = "python experiments/credit_assignment.py " + shlex.join(sys.argv[1:])
    results = {}
    if args.report_only:
        for seed in args.seeds:
            for arm in args.arms:
                done = args.runs_dir / f"{arm}-seed{seed}" / "summary.json"
                if done.exists():
                    results[(arm, seed)] = json.loads(done.read_text())
    else:
        model = warm_start(args)
        for seed in args.seeds:  # seeds outermost: a cut-short experiment still compares all
            for arm in args.arms:
                print(f"== {arm}, seed {seed}", flush=True)
                try:  # the starting policy is measured once, by the first run
                    results[(arm, seed)] = one_run(args, model, arm, seed,
                                                   evaluate_before=not results)
                except RunFailed as error:
                    print(f"run {arm} seed {seed} failed: {error}", file=sys.stderr)
                    return 1
    if not results:
        print("no finished runs", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    minutes = sum(r.get("seconds", 0.0) for r in results.values()) / 60
    args.out.write_text(report(args, results, command.replace(" --report-only", "").strip(),
                               minutes))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
