"""Do ``configs/textworld.yaml``'s warm starts land where they are asked to, seed after seed?

    python experiments/textworld_warm_starts.py                 # seeds 1 2 3 4
    python experiments/textworld_warm_starts.py --seeds 5 --config my.yaml
    python experiments/textworld_warm_starts.py --report-only   # the table of finished seeds

Each seed is the config's warm start as ``lachesis run`` makes it (its ``prepare_model``:
the tiny model, built once and shared by the seeds; the demonstrator's ε calibrated on
held-out games to ``warm_start.settings.target_success``; the demonstrations; the SFT),
with the seed in the demonstrations' draws (``warm_start.settings.seed``: 100 + seed) and
the SFT's (``warm_start.train.seed``). Then the SFT'd policy plays the env's held-out
games (``eval_items``, 256) through vLLM, sampled at the env's ``eval_temperature`` (1, as
RL samples): its success with a 95 % Wilson interval, against the band. Runs go to
``--runs-dir``/seed{N}; each seed's result is kept in ``seed{N}/warm_start.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from environments.inference.vllm_process import VLLMProcess  # noqa: E402
from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import Supervisor  # noqa: E402

CONFIG = REPO / "configs" / "textworld.yaml"


def seed_config(seed: int, runs_dir: Path, base: Path) -> dict[str, Any]:
    config = yaml.safe_load(base.read_text())
    config.update(name=f"seed{seed}", runs_dir=str(runs_dir))
    config["warm_start"]["settings"]["seed"] = 100 + seed
    config["warm_start"]["train"]["seed"] = seed
    return config


def evaluate(model: Path, config: RunConfig, out: Path) -> dict[str, Any]:
    """The env's evaluation of ``model`` (its first env entry's settings) on a vLLM of its
    own."""
    env = config.envs[0]
    settings = {**env.settings, "tokenizer": str(model), "eval_out": str(out / "eval.jsonl")}
    with VLLMProcess(model, max_model_len=config.vllm.max_model_len,
                     log_path=out / "vllm.log") as server:
        settings["inference_servers"] = [server.url]
        (out / "eval.yaml").write_text(yaml.safe_dump(settings))
        done = subprocess.run(
            [sys.executable, "-m", "lachesis.cli", "env", "evaluate", env.name,
             "--config", str(out / "eval.yaml"), "--log-level", "WARNING"],
            cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"evaluation failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


def run_seed(seed: int, runs_dir: Path, base: Path) -> dict[str, Any]:
    run_dir = runs_dir / f"seed{seed}"
    done = run_dir / "warm_start.json"
    if done.exists():
        return json.loads(done.read_text())
    config = RunConfig.model_validate(seed_config(seed, runs_dir, base))
    config.check_sections()
    run_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    supervisor = Supervisor(config, live=False)
    try:
        model = Path(supervisor.prepare_model())
    finally:
        supervisor.stop_all()
    sft_seconds = time.monotonic() - began
    demonstrator = json.loads((run_dir / "warm_start" / "demonstrator.json").read_text())
    began = time.monotonic()
    result = evaluate(model, config, run_dir)
    summary = {"seed": seed, "model": str(model), "demonstrator": demonstrator,
               "warm_start_seconds": round(sft_seconds, 1),
               "evaluation_seconds": round(time.monotonic() - began, 1),
               "sft_loss": last_losses(run_dir / "warm_start" / "metrics.jsonl"),
               "evaluation": result}
    done.write_text(json.dumps(summary, indent=2))
    return summary


def last_losses(path: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    tail = losses[-10:]
    return {"first": round(losses[0], 4), "last10_mean": round(sum(tail) / len(tail), 4),
            "steps": len(losses)}


def report(results: list[dict[str, Any]], band: tuple[float, float], metric: str) -> str:
    lo, hi = band
    lines = [f"| seed | demonstrator ε | demonstrator's success (calibration) | SFT loss "
             f"(first → last 10) | held-out {metric} [95 % CI] | in [{lo}, {hi}] | minutes |",
             "|---:|---:|---:|---|---|:-:|---:|"]
    inside = 0
    for r in results:
        e, d = r["evaluation"], r["demonstrator"]
        ci = e.get(f"{metric}_ci95") or [float("nan")] * 2
        calibrated = [t["success"] for t in d["calibration"] if t["epsilon"] == d["epsilon"]]
        ok = lo <= e[metric] <= hi
        inside += ok
        lines.append(
            f"| {r['seed']} | {d['epsilon']:.4f} | "
            f"{calibrated[-1] if calibrated else float('nan'):.3f} | "
            f"{r['sft_loss']['first']:.3f} → {r['sft_loss']['last10_mean']:.3f} | "
            f"{e[metric]:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | {'yes' if ok else 'no'} | "
            f"{(r['warm_start_seconds'] + r['evaluation_seconds']) / 60:.1f} |")
    lines.append(f"\n{inside} of {len(results)} seeds inside [{lo}, {hi}] "
                 f"({results[0]['evaluation']['items'] if results else 0} held-out games)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "textworld-warm-starts")
    parser.add_argument("--band", type=float, nargs=2, metavar=("LO", "HI"),
                        help="the band to check (default: warm_start.settings.target_success)")
    parser.add_argument("--metric", default="success")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    base = yaml.safe_load(args.config.read_text())
    band = tuple(args.band or base["warm_start"]["settings"]["target_success"])
    results = []
    for seed in args.seeds:
        path = args.runs_dir / f"seed{seed}" / "warm_start.json"
        if args.report_only:
            if path.exists():
                results.append(json.loads(path.read_text()))
            continue
        results.append(run_seed(seed, args.runs_dir, args.config))
        print(json.dumps({k: results[-1][k] for k in ("seed", "demonstrator",
                                                       "warm_start_seconds",
                                                       "evaluation_seconds", "sft_loss")}),
              flush=True)
    print(report(results, band, args.metric))


if __name__ == "__main__":
    main()
