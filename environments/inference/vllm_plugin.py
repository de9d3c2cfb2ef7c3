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


def plugin_installed() -> bool:
    return any(e.name == PLUGIN_NAME and e.value == PLUGIN_TARGET
               for e in importlib.metadata.entry_points(group=PLUGIN_GROUP))


def plugin_pythonpath() -> str | None:
    """A directory to put on a vLLM process's ``PYTHONPATH`` so that it finds the
    ``lachesis_weight_transfer`` plugin entry point, or None when the installed package
    declares it already. (A bare ``*.dist-info`` with ``entry_points.txt`` is all that
    ``importlib.metadata`` needs.)"""
    if plugin_installed():
        return None
    root = Path(tempfile.gettempdir()) / "lachesis-vllm-plugin"
    info = root / "lachesis_vllm_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    files = {"METADATA": "Metadata-Version: 2.1\nName: lachesis-vllm-plugin\nVersion: 0\n",
             "entry_points.txt": f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n"}
    for name, text in files.items():  # atomically: another process may be reading them
        tmp = info / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, info / name)
    return str(root)
