"""A checkpoint's tied weights written out, as vLLM CPU needs them (see
:func:`write_tied_weights`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TIED_WEIGHTS_FILE = "tied-weights.safetensors"


def write_tied_weights(path: Path, state: dict[str, Any]) -> list[str]:
    """Add to the checkpoint at ``path`` the weights that ``save_pretrained`` left out
    because they share storage with another (a tied ``lm_head.weight``); returns their
    names.

    Why: vLLM's in-place reload first gives every layer's parameters back as empty
    placeholders (its layerwise reload), which unties the output embedding from the input
    one for the time of the reload; a layer that then receives no weight keeps what it
    derived from the old ones. On the CPU build the output projection runs on a prepacked
    copy of its weight, so a checkpoint without ``lm_head.weight`` leaves vLLM sampling
    from the old head (measured: logprobs off by ~0.2 on average on a tiny tied model).
    With the weight in the checkpoint the head is loaded and repacked like every other
    layer; a fresh vLLM start skips it as an alias of the embedding. The in-memory
    transfer sends the full state dict, tied names included, for the same reason."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    saved: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            saved.update(f.keys())
    missing = {name: tensor for name, tensor in state.items() if name not in saved}
    if not missing:
        return []
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in missing.items()},
              str(path / TIED_WEIGHTS_FILE), metadata={"format": "pt"})
    index = next(path.glob("*.safetensors.index.json"), None)
    if index is not None:  # loaders read only the files the index names
        table = json.loads(index.read_text())
        table["weight_map"].update({name: TIED_WEIGHTS_FILE for name in missing})
        index.write_text(json.dumps(table, indent=2))
    return sorted(missing)


