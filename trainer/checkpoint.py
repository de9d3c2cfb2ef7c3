"""Checkpoints: the model (HF format, so vLLM and ``from_pretrained`` load it), the
tokenizer, the optimizer state, the step, the data position and the RNG states.

A checkpoint is written under a temporary name, every file flushed to disk, a manifest
(``checkpoint.json``: each file's size) written last, and only then renamed to
``step_NNNNNN``: a crash at any moment leaves either the complete checkpoint or a
``.tmp`` directory that is never loaded. On load the manifest is checked (every file
there, at its size) and the trainer state read; a checkpoint that fails is skipped for
the one before it. The newest ``keep`` checkpoints are kept.

torch is imported by the functions that read or write tensors: ``lachesis run``'s
supervisor finds checkpoints with this module and never loads torch (1.5 s of CPU a run).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("lachesis.train")
MANIFEST = "checkpoint.json"
STEP_METRICS = "metrics.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, model, optimizer_state: dict[str, Any], tokenizer,
                    data_position: int = 0, weights: dict[str, torch.Tensor] | None = None,
                    keep: int | None = None, metrics: dict[str, Any] | None = None) -> Path:
    """``weights``: a full state dict when the model is sharded (``full_state_dict``);
    ``keep``: how many of the newest checkpoints to keep (None: all); ``metrics``: the
    step's metrics line (``metrics.json``), logged again on resume if a crash before
    the line was written lost it."""
    import torch

    path = checkpoint_dir(run_dir, step)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # what a crash mid-write left
    model.save_pretrained(tmp, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer_state, "step": step,
                "data_position": data_position,
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                        "python": random.getstate()}}, tmp / "trainer_state.pt")
    if metrics is not None:
        (tmp / STEP_METRICS).write_text(json.dumps({"step": step, **metrics}, default=float))
    files = {p.relative_to(tmp).as_posix(): p.stat().st_size
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    for name in files:
        _fsync(tmp / name)
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    shutil.rmtree(path, ignore_errors=True)  # a resumed run writing a step again
    tmp.rename(path)
    _fsync(path.parent)
    if keep is not None:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Renamed (complete) checkpoint directories, oldest first (not yet verified)."""
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*")
                  if p.is_dir() and not p.name.endswith(".tmp"))


def verify(checkpoint: Path) -> str | None:
    """What is wrong with ``checkpoint`` (None: nothing): its manifest lists every file
    with its size; the trainer state must load."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except FileNotFoundError:  # written before manifests: renamed only once complete
        manifest = {"files": {"config.json": (checkpoint / "config.json").stat().st_size}
                    if (checkpoint / "config.json").exists() else {}}
    except (OSError, ValueError) as error:
        return f"no readable {MANIFEST} ({error})"
    for name, size in manifest["files"].items():
        try:
            found = (checkpoint / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if found != size:
            return f"{name} has {found} bytes, the manifest says {size}"
    import torch

    try:
        torch.load(checkpoint / "trainer_state.pt", weights_only=False, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - any unreadable state disqualifies it
        return f"trainer_state.pt does not load ({type(error).__name__}: {error})"
    return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; newer ones that do not are logged and
    skipped (a crash mid-write, a truncated file)."""
    for path in reversed(complete_checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        log.error("checkpoint %s is damaged (%s): falling back to the one before it",
                  path, problem)
    return None


def checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def discard_after(run_dir: Path, step: int) -> list[Path]:
    """Remove what the trainer wrote for steps after ``step`` (checkpoints that failed
    verification, synced weights and adapters of versions that no longer exist), so
    nothing (a restarted vLLM replica, a later resume) picks them up. Returns them."""
    gone = []
    for pattern in ("checkpoints/step_*", "weights/v*", "adapters/v*"):
        for path in run_dir.glob(pattern):
            digits = path.name.split("_")[-1].lstrip("v").split("-")[0].split(".")[0]
            if digits.isdigit() and int(digits) > step:
                shutil.rmtree(path, ignore_errors=True)
                gone.append(path)
    return gone


def restore(checkpoint: Path, model, optimizer, sharded: bool) -> tuple[int, int]:
    """Load the optimizer and RNG states of ``checkpoint`` (the model was loaded from it);
    returns ``(step, data_position)``."""
    import torch

    from trainer.distributed import load_optimizer_state

    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    load_optimizer_state(model, optimizer, state["optimizer"], sharded)
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    log.info("resumed from %s (step %d)", checkpoint, state["step"])
    return state["step"], state.get("data_position", 0)
