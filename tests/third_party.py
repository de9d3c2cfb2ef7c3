"""Virtual environments for third-party packages whose pins clash with the project's venv.

verifiers 0.4.0 pins ``mcp==2.0.0`` and ``openai<3``, and openenv-core 0.3.0 (through
gradio) ``pillow<13``: installed into the project's venv they would downgrade what vLLM and
the rest use. So the tests that run them build a venv each, once, under
``~/.cache/lachesis/NAME-venv`` (``LACHESIS_CACHE`` moves it), from PyPI, and run those
packages there as subprocesses: the verifiers adapter as a ``lachesis env`` process (our
package on ``PYTHONPATH``), an OpenEnv server as its own uvicorn process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LACHESIS_CACHE", Path.home() / ".cache" / "lachesis"))


def requirements(extra: str | None = None) -> list[str]:
    """The project's own dependencies (pyproject ``[project] dependencies``), or those of
    one of its extras."""
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return list(project["dependencies"] if extra is None
                else project["optional-dependencies"][extra])


def third_party_venv(name: str, requirements: list[str], timeout_s: float = 1200) -> Path:
    """The python of ``CACHE/NAME-venv`` with ``requirements`` installed; built on first
    use, and again when the requirements change (a stamp of them sits in the venv)."""
    venv = CACHE / f"{name}-venv"
    python = venv / "bin" / "python"
    stamp = venv / ".lachesis-requirements"
    wanted = hashlib.sha256(json.dumps(sorted(requirements)).encode()).hexdigest()
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time
        if python.exists() and stamp.exists() and stamp.read_text() == wanted:
            return python
        # the base interpreter of the running venv (not the venv itself)
        base = Path(getattr(sys, "_base_executable", sys.executable))
        subprocess.run([str(base), "-m", "venv", "--clear", str(venv)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements],
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"building {venv} failed:\n{done.stderr[-4000:]}")
        stamp.write_text(wanted)
    return python


def verifiers_python() -> Path:
    """A venv for a ``lachesis env`` process with the ``verifiers`` extra (verifiers 0.4.0,
    transformers at the version used here) and the project's own dependencies."""
    pinned = [f"transformers=={version('transformers')}" if r == "transformers" else r
              for r in requirements("verifiers")]
    return third_party_venv("verifiers", [*pinned, *requirements()])


def openenv_python() -> Path:
    """A venv with the ``openenv`` extra (openenv-core 0.3.0, which brings uvicorn), to run
    OpenEnv servers."""
    return third_party_venv("openenv", requirements("openenv"))
