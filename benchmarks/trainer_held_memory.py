"""What a CPU trainer holds between steps, with and without giving freed memory back
(``train.release_memory_each_step``), side by side in one run.

Two offline ``lachesis train`` runs, one after the other, each in a fresh process, on the
same file of synthetic groups: SmolLM2-135M-Instruct (the packaged model, ``dtype: auto``),
batches of 2 groups of 8 sequences of 200-1,199 random tokens (the first 100 a masked
prompt; 9-13k tokens a batch, changing from step to step, as an agent's episodes do),
packed micro-batches of at most 4,096 tokens, GRPO. Per step it prints the batch's
tokens, ``memory/peak_gib`` and ``memory/held_gib`` (trainer/memory.py) and
``time/train``; then the ratios of the last step's held memory and of the mean
``time/train`` (steps 2 on: the first pays for the start), ``release`` over ``keep``.
Targets: held <= 0.5 x, time <= 1.1 x.

    .venv/bin/python benchmarks/trainer_held_memory.py --steps 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VARIANTS = {"keep": False, "release": True}


def write_groups(path: Path, steps: int, seed: int = 0) -> None:
    from environments.jsonl_store import GroupWriter
    from environments.trajectory import ScoredGroup, ScoredTrajectory

    rng = random.Random(seed)
    groups = []
    for _ in range(steps * 2):
        trajectories = []
        for i in range(8):
            n = rng.randrange(200, 1200)
            tokens = [rng.randrange(1, 49_000) for _ in range(n)]
            trajectories.append(ScoredTrajectory(
                tokens=tokens, masks=[-100] * 100 + tokens[100:],
                inference_logprobs=[1.0] * 100 + [-2.0] * (n - 100), scores=float(i % 2)))
        groups.append(ScoredGroup(trajectories=trajectories))
    GroupWriter(path).append(groups)


def child(data: Path, run_dir: Path, steps: int, release: bool) -> None:
    from trainer.config import TrainConfig
    from trainer.train import train

    asyncio.run(train(TrainConfig(
        model="smollm2-135m-instruct", data=data, run_dir=run_dir, batch_size=16,
        steps=steps, lr=1e-5, dtype="auto", estimator="grpo",
        max_tokens_per_micro_batch=4096, check_alignment=False, tensorboard=False,
        checkpoint_every=10_000, release_memory_each_step=release)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        data, run_dir, variant = args.child
        child(Path(data), Path(run_dir), args.steps, VARIANTS[variant])
        return 0
    work = Path(tempfile.mkdtemp(prefix="held-memory-"))
    try:
        write_groups(work / "groups.jsonl", args.steps)
        rows = {}
        for variant in VARIANTS:
            run_dir = work / variant
            subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child",
                            str(work / "groups.jsonl"), str(run_dir), variant],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            rows[variant] = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
            print(f"{variant}:")
            for r in rows[variant]:
                print(f"  step {r['step']}  {r['row_tokens']:6d} tokens  peak "
                      f"{r['memory/peak_gib']:5.2f} GiB  held {r['memory/held_gib']:5.2f} GiB  "
                      f"train {r['time/train']:5.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    held = rows["release"][-1]["memory/held_gib"] / rows["keep"][-1]["memory/held_gib"]
    seconds = {v: statistics.mean(r["time/train"] for r in rows[v][1:]) for v in VARIANTS}
    time_ratio = seconds["release"] / seconds["keep"]
    print(f"held_release_over_keep: {held:.3f} (target <= 0.5: {'met' if held <= 0.5 else 'missed'})")
    print(f"train_time_release_over_keep: {time_ratio:.3f} "
          f"(target <= 1.1: {'met' if time_ratio <= 1.1 else 'missed'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "held_ratio": held,
                                               "time_ratio": time_ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
