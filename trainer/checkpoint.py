"""Checkpoints: the model (HF format, so vLLM and ``from_pretrained`` load it), the
tokenizer, the optimizer state, the step, the data position and the RNG states."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.distributed import load_optimizer_state

log = logging.getLogger("lachesis.train")


def save_checkpoint(run_dir: Path, step: int, model, optimizer_state: dict[str, Any], tokenizer,
                    data_position: int = 0, weights: dict[str, torch.Tensor] | None = None
                    ) -> Path:
    """``weights``: a full state dict when the model is sharded (``full_state_dict``)."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer_state, "step": step,
                "data_position": data_position,
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                        "python": random.getstate()}}, tmp / "trainer_state.pt")
    tmp.rename(path)
    return path


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(p for p in (run_dir / "checkpoints").glob("step_*")
                   if not p.name.endswith(".tmp"))
    return found[-1] if found else None


def restore(checkpoint: Path, model, optimizer, sharded: bool) -> tuple[int, int]:
    """Load the optimizer and RNG states of ``checkpoint`` (the model was loaded from it);
    returns ``(step, data_position)``."""
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    load_optimizer_state(model, optimizer, state["optimizer"], sharded)
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    log.info("resumed from %s (step %d)", checkpoint, state["step"])
    return state["step"], state.get("data_position", 0)
