"""The ``lachesis_weight_transfer`` vLLM plugin's entry point, and how a vLLM started
from a source tree finds it. Apart from :mod:`environments.inference.weight_transfer`
(which imports vLLM, seconds on a CPU) so that what only starts vLLM servers (the
``lachesis run`` supervisor, ``lachesis run --plan``) does not import vLLM itself."""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from pathlib import Path

BACKENDS = ("gloo", "shm")
"""The weight-transfer backends the plugin adds to vLLM."""
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "lachesis_weight_transfer"
PLUGIN_TARGET = "environments.inference.weight_transfer:register"
LOGITS_GROUP = "vllm.logits_processors"
LOGITS_NAME = "lachesis_forced_tokens"
LOGITS_TARGET = "environments.inference.forced_tokens:ForcedTokens"
"""The forced-turns logits processor (:mod:`environments.inference.forced_tokens`)."""
ENTRY_POINTS = ((PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_TARGET),
                (LOGITS_GROUP, LOGITS_NAME, LOGITS_TARGET))


def _missing() -> list[tuple[str, str, str]]:
    """The entry points the installed packages do not declare."""
    return [(group, name, target) for group, name, target in ENTRY_POINTS
            if not any(e.name == name and e.value == target
                       for e in importlib.metadata.entry_points(group=group))]


def plugin_installed() -> bool:
    return not _missing()


def plugin_pythonpath() -> str | None:
    """A directory to put on a vLLM process's ``PYTHONPATH`` so that it finds the
    ``lachesis_weight_transfer`` plugin and the forced-tokens logits processor entry points
    the installed package does not declare, or None when it declares both. (A bare ``*.dist-info`` with ``entry_points.txt`` is all that
    ``importlib.metadata`` needs.)"""
    missing = _missing()
    if not missing:
        return None
    names = "-".join(name for _, name, _ in missing)
    root = Path(tempfile.gettempdir()) / f"lachesis-vllm-plugin-{names}"
    info = root / "lachesis_vllm_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    files = {"METADATA": "Metadata-Version: 2.1\nName: lachesis-vllm-plugin\nVersion: 0\n",
             "entry_points.txt": "".join(f"[{group}]\n{name} = {target}\n"
                                         for group, name, target in missing)}
    for name, text in files.items():  # atomically: another process may be reading them
        tmp = info / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, info / name)
    return str(root)
