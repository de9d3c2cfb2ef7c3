"""What a deterministic run costs, and whether it repeats: one cell of the credit-assignment
study (configs/credit_assignment.yaml, an arm and a seed) run three times in one go, from
one warm start:

  1. as the study runs it (asynchronous: rollouts one batch ahead, unseeded sampling);
  2. with ``deterministic: true`` (docs/determinism.md): seeded requests, lockstep with
     the trainer;
  3. the same deterministic run again.

It prints each run's wall time and mean trainer step time, the ratio deterministic /
asynchronous, and whether runs 2 and 3 are the same: the tokens of every trained group
in order, every step's metrics, and the final evaluation. (Runs 1 and 2 are compared too,
for contrast.) ``--json OUT`` writes it all.

    python benchmarks/determinism.py --model runs/confirmatory/warm-start/warm_start/final \\
        --arm grpo --seed 0 --steps 20 --json runs/determinism.json

Without ``--model`` the study's warm start is built (or reused) under ``--runs-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))

import credit_assignment as ca  # noqa: E402
from confirmatory import ARMS  # noqa: E402

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import run_quietly  # noqa: E402

VOLATILE = ("seconds", "per_second")
"""Metric names that measure time or the queue, not what was trained."""


def trained_tokens(run_dir: Path) -> list[list[list[int]]]:
    """Each group the env delivered, in order: its trajectories' token ids."""
    groups = []
    for path in sorted((run_dir / "trajectories").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                groups.append([t["tokens"] for t in json.loads(line)["trajectories"]])
    return groups


def step_values(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if not any(w in k for w in VOLATILE)}
            for m in ca.read_metrics(run_dir)]


def first_difference(a: list[Any], b: list[Any]) -> int | None:
    """The index of the first element that differs (or where one list ends); None: equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def one_run(args: argparse.Namespace, model: str, label: str, deterministic: bool
            ) -> dict[str, Any]:
    config = ca.arm_config(args, model, args.arm, args.seed, evaluate_before=False,
                           arms=ARMS).model_dump()
    config.update(name=f"{label}-{args.arm}-seed{args.seed}", deterministic=deterministic)
    config = RunConfig.model_validate(config)
    run_dir = config.run_dir
    print(f"== {label}: {run_dir}", flush=True)
    if (run_dir / "timed-summary.json").exists():  # finished by an earlier call: reused
        summary = json.loads((run_dir / "timed-summary.json").read_text())
    else:
        summary = run_quietly(config)
        (run_dir / "timed-summary.json").write_text(json.dumps(summary, default=str))
    steps = [m.get("step_seconds", 0.0) for m in ca.read_metrics(run_dir)]
    after = {k: v for k, v in (summary.get("after") or {}).items()}
    print(f"   {summary['seconds']:.0f} s, {statistics.mean(steps):.2f} s per trainer step",
          flush=True)
    return {"run_dir": str(run_dir), "seconds": summary["seconds"],
            "mean_step_seconds": statistics.mean(steps), "after": after,
            "groups": trained_tokens(run_dir), "steps": step_values(run_dir)}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {"first_different_group": first_difference(a["groups"], b["groups"]),
            "first_different_step": first_difference(a["steps"], b["steps"]),
            "same_evaluation": a["after"] == b["after"],
            "groups": [len(a["groups"]), len(b["groups"])]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "credit_assignment.yaml")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "determinism")
    parser.add_argument("--model", default=None, help="the warm start (default: built)")
    parser.add_argument("--arm", default="grpo", choices=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or ca.warm_start(args)
    runs = {"asynchronous": one_run(args, model, "async", False),
            "deterministic": one_run(args, model, "det-a", True),
            "deterministic again": one_run(args, model, "det-b", True)}
    a, d, d2 = runs["asynchronous"], runs["deterministic"], runs["deterministic again"]
    result = {
        "arm": args.arm, "seed": args.seed, "steps": args.steps, "model": model,
        "seconds": {k: round(v["seconds"], 1) for k, v in runs.items()},
        "mean_step_seconds": {k: round(v["mean_step_seconds"], 3) for k, v in runs.items()},
        "ratio_wall": round((d["seconds"] + d2["seconds"]) / 2 / a["seconds"], 2),
        "ratio_step": round((d["mean_step_seconds"] + d2["mean_step_seconds"]) / 2
                            / a["mean_step_seconds"], 2),
        "deterministic_runs": compare(d, d2),
        "asynchronous_vs_deterministic": compare(a, d),
        "after": {k: v["after"] for k, v in runs.items()},
        "run_dirs": {k: v["run_dir"] for k, v in runs.items()},
    }
    same = result["deterministic_runs"]
    print(json.dumps({k: v for k, v in result.items() if k != "after"}, indent=2))
    print(f"deterministic / asynchronous: {result['ratio_wall']}x wall, "
          f"{result['ratio_step']}x per trainer step; the two deterministic runs are "
          + ("the same (every group's tokens, every step's metrics, the evaluation)"
             if same["first_different_group"] is None and same["first_different_step"] is None
             and same["same_evaluation"] else f"NOT the same: {same}"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
