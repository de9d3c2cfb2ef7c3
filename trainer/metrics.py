"""What a step reports: ``metrics.jsonl`` (always), TensorBoard and Weights & Biases
(when installed and asked for), and a progress line or bar."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("lachesis.train")


class Progress:
    """A progress bar on a terminal (tqdm); one line per step in logs and pipes."""

    def __init__(self, start: int, total: int):
        self.total = total
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, values: dict[str, Any]) -> None:
        fields = {"reward": f"{values.get('reward_mean', float('nan')):.3f}",
                  "loss": f"{values.get('loss', 0.0):.4f}",
                  "kl": f"{values.get('approx_kl', 0.0):.2e}",
                  "clip": f"{values.get('clip_fraction', 0.0):.3f}",
                  "tok/s": f"{values['tokens_per_second']:.0f}"}
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        else:
            print(f"step {step}/{self.total}  " + "  ".join(f"{k} {v}" for k, v in fields.items()),
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Metrics:
    def __init__(self, run_dir: Path, tensorboard: bool, wandb: bool = False,
                 config: dict[str, Any] | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a")
        self.writer = None
        self.wandb = None
        if wandb:
            try:
                import wandb as wandb_module

                self.wandb = wandb_module.init(project="lachesis", dir=str(run_dir),
                                               config=config, resume="allow")
            except ImportError:
                log.warning("wandb is not installed; metrics go to metrics.jsonl only")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed; metrics go to metrics.jsonl only")

    def log(self, step: int, values: dict[str, Any]) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


STOPPED_EARLY = "stopped_early.json"
"""In the trainer's ``run_dir`` when training ended before ``steps`` because no trainable
batch came for ``max_batch_wait_s`` (``step``, ``steps``, ``waited_s``, ...)."""


def write_stopped_early(run_dir: Path, record: dict[str, Any] | None) -> None:
    """Write the record (None: remove a stale one, as a (re)started trainer does)."""
    path = run_dir / STOPPED_EARLY
    if record is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def read_stopped_early(run_dir: Path) -> dict[str, Any] | None:
    """The record of a trainer that stopped early (None: it did not)."""
    try:
        return json.loads((run_dir / STOPPED_EARLY).read_text())
    except (OSError, ValueError):
        return None


def stopped_early_text(record: dict[str, Any]) -> str:
    """``training stopped early at step K of N: no trainable batch for S s``."""
    return (f"training stopped early at step {record['step']} of {record['steps']}: "
            f"no trainable batch for {record['waited_s']:.0f} s")
