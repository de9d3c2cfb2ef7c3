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
import shutil
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
        uv = Path(sys.executable).parent / "uv"  # `make install` puts uv in the venv
        if uv.exists():  # ~5x faster than pip (77 s -> 15 s for verifiers on a new machine)
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([str(uv), "venv", "-q", "--python", str(base), str(venv)],
                           check=True)
            command = [str(uv), "pip", "install", "-q", "--python", str(python),
                       *uv_sources(base), *requirements]
        else:
            subprocess.run([str(base), "-m", "venv", "--clear", str(venv)], check=True)
            command = [str(python), "-m", "pip", "install", "-q", *requirements]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"building {venv} failed:\n{done.stderr[-4000:]}")
        stamp.write_text(wanted)
    return python


def uv_sources(python: Path) -> list[str]:
    """pip's index, extra indexes and find-links (its configuration and ``PIP_*``
    variables) as uv's flags, which reads no pip configuration: where pip finds packages
    here, uv does too (as `make install` hands them to uv)."""
    def pip_config(key: str) -> list[str]:
        done = subprocess.run([str(python), "-m", "pip", "config", "get", f"global.{key}"],
                              capture_output=True, text=True)
        return done.stdout.split() if done.returncode == 0 else []

    flags = ["--index-strategy", "unsafe-best-match"]
    for key, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"),
                      ("find-links", "--find-links")):
        values = os.environ.get(f"PIP_{key.upper().replace('-', '_')}", "").split() \
            or pip_config(key)
        for value in values[:1] if key == "index-url" else values:
            flags += [flag, value]
    return flags


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


def statcheck_python() -> Path:
    """A venv with numpy, scipy and statsmodels, for the studies' independent checks
    (``experiments/stress_check.py``, ``experiments/textworld_credit_check.py``,
    ``experiments/wiki_search_credit_check.py``), which
    import nothing of the project's."""
    return third_party_venv("statcheck", ["numpy", "scipy", "statsmodels"])
