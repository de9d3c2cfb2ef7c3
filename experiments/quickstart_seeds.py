"""The quickstart (``make demo``) with other seeds: does the gain hold beyond one run?

    python experiments/quickstart_seeds.py                  # seeds 1 2 3
    python experiments/quickstart_seeds.py --seeds 4 5
    python experiments/quickstart_seeds.py --report-only    # table of finished runs
    python experiments/quickstart_seeds.py --config my.yaml --runs-dir runs/my-seeds

    python experiments/quickstart_seeds.py --config configs/smollm2.yaml \
        --runs-dir runs/smollm2-seeds                       # make demo's SmolLM2 run

Each seed is the whole quickstart as ``lachesis run`` does it, from scratch: a new tiny
model (weights and learned tokenizer; a packaged model such as SmolLM2 stays the
same), a new warm start, new training items, new
held-out evaluation items and a new trainer seed; nothing else differs from
``configs/quickstart.yaml`` (or the ``--config`` given: to compare settings over the
same seeds). Runs go to ``runs/quickstart-seeds/seed{N}``. Reported: answer
accuracy and tool-call success before and after RL (256 held-out items, sampled at the
training temperature, 95 % Wilson intervals), per seed and as mean ± std over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import run_quietly  # noqa: E402

ENV = "arithmetic_tool"
METRICS = [("correct", "answer accuracy"), ("tool_success", "tool-call success")]


QUICKSTART = REPO / "configs" / "quickstart.yaml"


def seed_config(seed: int, runs_dir: Path, base: Path = QUICKSTART) -> dict[str, Any]:
    config = yaml.safe_load(base.read_text())
    config.update(name=f"seed{seed}", runs_dir=str(runs_dir))
    if "build_tiny_model" in config:  # a new random model per seed; a real one stays
        config["model"] = str(runs_dir / f"model-seed{seed}")
        config["build_tiny_model"] = {**config["build_tiny_model"], "seed": seed}
    config["warm_start"]["settings"]["seed"] = 100 + seed
    config["warm_start"]["train"]["seed"] = seed
    config["envs"][0]["settings"]["seed"] = seed
    config["train"]["seed"] = seed
    return config


def run_seed(seed: int, runs_dir: Path, base: Path = QUICKSTART) -> dict[str, Any]:
    run_dir = runs_dir / f"seed{seed}"
    done = run_dir / "seed_summary.json"
    if done.exists():
        return json.loads(done.read_text())
    summary = run_quietly(RunConfig.model_validate(seed_config(seed, runs_dir, base)))
    done.write_text(json.dumps(summary, indent=2, default=str))
    return summary


def report(results: dict[int, dict[str, Any]]) -> str:
    def cell(d: dict[str, Any], key: str) -> str:
        ci = d.get(f"{key}_ci95")
        return f"{d[key]:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{d[key]:.3f}"

    lines = ["| seed | " + " | ".join(f"{label} before | after | change"
                                      for _, label in METRICS)
             + " | minutes |", "|---:|" + "---:|---:|---:|" * len(METRICS) + "---:|"]
    for seed, s in sorted(results.items()):
        b, a = s["before"][ENV], s["after"][ENV]
        lines.append(f"| {seed} | " + " | ".join(f"{cell(b, k)} | {cell(a, k)} | "
                                                  f"{a[k] - b[k]:+.3f}" for k, _ in METRICS)
                     + f" | {s.get('seconds', 0) / 60:.1f} |")
    lines.append("")
    for key, label in METRICS:
        before = [s["before"][ENV][key] for s in results.values()]
        after = [s["after"][ENV][key] for s in results.values()]
        gain = [y - x for x, y in zip(before, after)]
        std = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
        lines.append(f"- {label}: before {statistics.mean(before):.3f} ± {std(before):.3f}, "
                     f"after {statistics.mean(after):.3f} ± {std(after):.3f}, change "
                     f"{statistics.mean(gain):+.3f} ± {std(gain):.3f} (mean ± std over "
                     f"{len(results)} seeds)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "quickstart-seeds")
    parser.add_argument("--config", type=Path, default=QUICKSTART,
                        help="the quickstart config to run per seed (default: %(default)s)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    results = {}
    for seed in args.seeds:
        done = args.runs_dir / f"seed{seed}" / "seed_summary.json"
        if args.report_only:
            if done.exists():
                results[seed] = json.loads(done.read_text())
            continue
        print(f"seed {seed}: running the quickstart", flush=True)
        results[seed] = run_seed(seed, args.runs_dir, args.config)
    if not results:
        print("no finished runs", file=sys.stderr)
        return 1
    table = report(results)
    print(table)
    (args.runs_dir / "report.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
