"""What an RL step of ``configs/textworld.yaml`` costs on this machine, per horizon.

    python experiments/textworld_pilot.py --horizons short long --steps 3

For each horizon: ``configs/textworld.yaml``'s RL phase as ``lachesis run`` runs it (its
env and trainer settings, the horizon changed), for ``--steps`` steps, without the warm
start and without evaluations, from ``--model`` (default: the config's tiny model). Give
it a warm-started policy (e.g. ``runs/textworld-warm-starts/seed1/warm_start/final``):
the untrained model never ends a reply within ``max_tokens_per_turn``, so its episodes
end, truncated, at their first turn. The short horizon's warm start plays the long
horizon's games too, mostly to their step budget: the longest episodes. ``--train-games`` and
``--eval-items`` shrink the pools the pilot needs generated (the long horizon's games take
4.5 s each). Printed, per horizon: the run's seconds (all phases), each step's seconds,
its trained rows and tokens, its sampled (trained) tokens, the rollouts' generation
seconds, and the episodes' turns, from the trainer's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import run_quietly  # noqa: E402

CONFIG = REPO / "configs" / "textworld.yaml"


def pilot_config(base: Path, horizon: str, steps: int, runs_dir: Path, train_games: int,
                 eval_items: int, model: str | None) -> dict[str, Any]:
    config = yaml.safe_load(base.read_text())
    config.pop("warm_start", None)
    if model is not None:
        config.update(model=model, build_tiny_model=False)
    config.update(name=f"pilot-{horizon}", runs_dir=str(runs_dir), evaluate=False)
    env = config["envs"][0]["settings"]
    env.update(horizon=horizon, train_games=train_games, eval_items=eval_items)
    config["train"].update(steps=steps, checkpoint_every=steps)
    return config


def summarize(run_dir: Path, seconds: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in
            (run_dir / "trainer" / "metrics.jsonl").read_text().splitlines() if line.strip()]

    def column(key: str) -> list[float]:
        return [round(r[key], 2) for r in rows if key in r]

    later = rows[1:] or rows  # the first step also waits for the first batch's rollouts
    return {"run_seconds": round(seconds, 1), "steps": len(rows),
            "step_seconds": column("step_seconds"),
            "step_seconds_after_the_first": round(statistics.mean(
                r["step_seconds"] for r in later), 2),
            "train_seconds": column("time/train"), "rows": column("rows"),
            "row_tokens": column("row_tokens"), "trained_tokens": column("trained_tokens"),
            "generation_seconds_per_rollout": column("env/time/generation"),
            "env_steps_per_episode": column("env/steps"),
            "won": column("env/won"), "out_of_budget": column("env/env_truncated"),
            "reward_mean": column("reward_mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horizons", nargs="+", default=["short", "long"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "textworld-pilot")
    parser.add_argument("--train-games", type=int, default=16)
    parser.add_argument("--eval-items", type=int, default=16)
    parser.add_argument("--model", help="the policy (default: the config's model)")
    args = parser.parse_args()
    for horizon in args.horizons:
        config = RunConfig.model_validate(pilot_config(
            args.config, horizon, args.steps, args.runs_dir, args.train_games,
            args.eval_items, args.model))
        began = time.monotonic()
        run_quietly(config)
        print(json.dumps({"horizon": horizon, **summarize(config.run_dir,
                                                          time.monotonic() - began)}),
              flush=True)


if __name__ == "__main__":
    main()
