"""Credit assignment on ``arithmetic_tool``: GRPO-OR, GRPO-MR, MT-GRPO and turn-RTG from
the same warm start, with the same seeds and the same budget.

    python experiments/credit_assignment.py                      # 5 arms x 3 seeds
    python experiments/credit_assignment.py --arms grpo mt_grpo --seeds 0 --steps 5
    python experiments/credit_assignment.py --report-only        # table of finished runs

Every run is a real ``lachesis run`` (rollout API, vLLM, env server, trainer as processes)
started from one shared SFT warm start; the arm (advantage estimator, or turn-prefix
samples) and the seed are the only differences. The setting is one where tool use matters: the tiny model cannot compute
products of two-digit numbers, so a correct answer needs a working calculator call.

Reported per arm (mean and spread over seeds): tool-execution success and exact
match of the final evaluation (sampled at the training temperature), the mean reward, and
the first trainer step at which the batches' tool success (3-step moving average) reaches
the threshold. The report goes to ``runs/credit_assignment.md`` (``--out``), the plot to
``docs/credit_assignment.png``.
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

# arm -> (label, trainer settings)
ARMS = {
    "grpo": ("GRPO-OR (outcome)", {"estimator": "grpo"}),
    "grpo_merged": ("GRPO-MR (summed turns)", {"estimator": "grpo_merged"}),
    "mt_grpo": ("MT-GRPO", {"estimator": "mt_grpo"}),
    "turn_rtg": ("turn-RTG (length-robust)", {"estimator": "turn_rtg"}),
    # One row per turn prefix, each weighted as a sequence: under token_mean the rows
    # would give exactly the gradient of one row per trajectory (README, Training).
    "turn_prefix": ("turn-prefix samples (turn-RTG, sequence mean)",
                    {"estimator": "turn_rtg", "samples": "turn_prefix",
                     "aggregation": "sequence_mean"}),
}


def base_config(args: argparse.Namespace) -> dict[str, Any]:
    """The quickstart's settings, with this experiment's budget."""
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["runs_dir"] = str(args.runs_dir)
    config["model"] = str(args.runs_dir / "tiny-model")
    config["train"].update(steps=args.steps, lr=args.lr, checkpoint_every=args.steps)
    config["envs"][0]["settings"]["eval_items"] = args.eval_items
    config["warm_start"]["train"]["steps"] = args.warm_start_steps
    return config


def warm_start(args: argparse.Namespace) -> str:
    """One SFT warm start shared by every run (reused when it exists)."""
    config = RunConfig.model_validate({**base_config(args), "name": "warm-start"})
    config.run_dir.mkdir(parents=True, exist_ok=True)
    return Supervisor(config, live=False).prepare_model()


def one_run(args: argparse.Namespace, model: str, arm: str, seed: int, *,
            evaluate_before: bool) -> dict[str, Any]:
    name = f"{arm}-seed{seed}"
    run_dir = args.runs_dir / name
    if (run_dir / "summary.json").exists():  # finished earlier: reuse
        return json.loads((run_dir / "summary.json").read_text())
    values = base_config(args)
    values.update(name=name, model=model, warm_start=None, build_tiny_model=False,
                  evaluate_before=evaluate_before)
    values["train"].update(**ARMS[arm][1], seed=seed)
    values["envs"][0]["settings"]["seed"] = 1000 + seed
    summary = run_quietly(RunConfig.model_validate(values))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def steps_to_threshold(metrics: list[dict[str, Any]], key: str, threshold: float,
                       window: int = 3) -> int | None:
    values = [m.get(key) for m in metrics]
    for i in range(window - 1, len(values)):
        recent = values[i - window + 1:i + 1]
        if None not in recent and sum(recent) / window >= threshold:
            return metrics[i]["step"]
    return None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "trainer" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def report(args: argparse.Namespace, results: dict[tuple[str, int], dict[str, Any]],
           command: str, minutes: float) -> str:
    env = "arithmetic_tool"
    before = next(r["before"][env] for r in results.values() if "before" in r)
    lines = [
        "# Credit assignment on `arithmetic_tool`", "",
        f"Command: `{command}` (the RL runs took {minutes:.0f} minutes on this 2-core "
        "machine).", "",
        f"Every run: the same SFT warm start ({args.warm_start_steps} steps on oracle "
        f"demonstrations), {args.steps} RL steps of 8 groups x 8 rollouts, lr {args.lr}, "
        f"evaluation on {args.eval_items} held-out items sampled at temperature 1.0. Seeds: "
        f"{', '.join(map(str, args.seeds))} (the seed sets the trainer's and the env's "
        "random streams). Threshold: batch tool success (3-step moving average) >= "
        f"{args.threshold}.", "",
        f"Warm start, before RL: tool success {before['tool_success']:.3f}, exact match "
        f"{before['exact_match']:.3f}, correct number {before['correct']:.3f}, mean "
        f"outcome {before['mean_outcome']:.3f}.", "",
        "| arm | tool success | exact match | correct number | mean outcome | "
        "steps to threshold |", "|---|---:|---:|---:|---:|---:|"]
    curves = {}
    for arm in args.arms:
        runs = [(seed, results[(arm, seed)]) for seed in args.seeds if (arm, seed) in results]
        if not runs:
            continue
        after = [r["after"][env] for _, r in runs]
        reached = []
        for seed, _ in runs:
            metrics = read_metrics(args.runs_dir / f"{arm}-seed{seed}")
            reached.append(steps_to_threshold(metrics, "env/tool_success", args.threshold))
            curves.setdefault(arm, []).append([m.get("env/tool_success") for m in metrics])
        reached_text = ", ".join("never" if s is None else str(s) for s in reached)
        lines.append(
            f"| {ARMS[arm][0]} | {mean_sd([a['tool_success'] for a in after])} | "
            f"{mean_sd([a['exact_match'] for a in after])} | "
            f"{mean_sd([a['correct'] for a in after])} | "
            f"{mean_sd([a['mean_outcome'] for a in after])} | {reached_text} |")
    plot(curves, args.out.parent / "credit_assignment.png")
    lines += ["", "Values: mean ± standard deviation over seeds; steps to threshold per seed.",
              "", "![tool success during RL](credit_assignment.png)", ""]
    return "\n".join(lines)


def plot(curves: dict[str, list[list[float | None]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for arm, runs in curves.items():
        n = min(len(r) for r in runs)
        mean = [statistics.mean(r[i] or 0.0 for r in runs) for i in range(n)]
        ax.plot(range(1, n + 1), mean, label=ARMS[arm][0])
    ax.set_xlabel("trainer step")
    ax.set_ylabel("tool success in the batch (mean over seeds)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warm-start-steps", type=int, default=120)
    parser.add_argument("--eval-items", type=int, default=128)
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "credit_assignment")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "credit_assignment.md",
                        help="the report (copy what you want to keep into docs/results.md)")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report from the runs that finished; start none")
    args = parser.parse_args()
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    minutes = sum(r.get("seconds", 0.0) for r in results.values()) / 60
    args.out.write_text(report(args, results, command.replace(" --report-only", "").strip(),
                               minutes))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
