"""The agent runtime: a read-only directory mounted into every black-box sandbox.

It holds the reference agent, the launcher (:mod:`environments.blackbox.agents.launch`),
the agent script of the catalog's ``openai-agents`` harness (run by that harness's own
Python, never with ``site/``) and, under ``site/``, the ``openai`` package and everything
it requires, copied from this Python environment (no network needed). The sandbox's own
``python3`` imports them with ``PYTHONPATH=/opt/lachesis/site`` when it runs the reference
agent, so its minor version must match this interpreter's
(binary wheels such as ``pydantic_core`` are built for one); :func:`check_sandbox_python`
says so clearly when it does not.

The directory is built once per content (a hash of the scripts and package versions) under
the temp dir, readable by every uid (sandboxes run as their own uids).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

MOUNT = "/opt/lachesis"
"""Where the runtime appears inside sandboxes."""
HERE = Path(__file__).resolve().parent
SCRIPTS = ("reference_agent.py", "launch.py", "openai_agents_agent.py")
REFERENCE_AGENT = f"{MOUNT}/reference_agent.py"
LAUNCHER = f"{MOUNT}/launch.py"


def _distributions(root: str) -> list[metadata.Distribution]:
    """``root`` and everything it requires (extras left out), each once."""
    seen: dict[str, metadata.Distribution] = {}
    pending = [root]
    while pending:
        name = pending.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        dist = metadata.distribution(name)
        seen[key] = dist
        for spec in dist.requires or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return sorted(seen.values(), key=lambda d: d.metadata["Name"].lower())


def _fingerprint(dists: list[metadata.Distribution]) -> str:
    digest = hashlib.sha256(f"{sys.version_info[:2]}".encode())
    for dist in dists:
        digest.update(f"{dist.metadata['Name']}=={dist.version};".encode())
    for script in SCRIPTS:
        digest.update((HERE / script).read_bytes())
    return digest.hexdigest()[:12]


def build_runtime(root: str | Path | None = None) -> Path:
    """The runtime directory (built if missing); returns its host path."""
    dists = _distributions("openai")
    root = Path(root or tempfile.gettempdir())
    target = root / f"lachesis-agent-runtime-{_fingerprint(dists)}"
    if target.is_dir():
        return target
    staging = Path(tempfile.mkdtemp(prefix=".agent-runtime-", dir=root))
    try:
        site = staging / "site"
        site.mkdir()
        for dist in dists:
            for file in dist.files or []:
                if file.parts[0] == ".." or file.suffix == ".pyc":
                    continue  # console scripts; caches are rebuilt (read-only: skipped)
                source = Path(dist.locate_file(file))
                if source.is_file():
                    (site / file).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, site / file)
        for script in SCRIPTS:
            shutil.copyfile(HERE / script, staging / script)
        for directory, _, files in os.walk(staging):
            os.chmod(directory, 0o755)
            for name in files:
                os.chmod(os.path.join(directory, name), 0o644)
        try:
            staging.rename(target)
        except OSError:  # built meanwhile by another process
            if not target.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def runtime_env(root: str | Path = MOUNT) -> dict[str, str]:
    """Environment variables that let python3 import the runtime found at ``root`` (in a
    sandbox: where it is mounted)."""
    return {"PYTHONPATH": f"{root}/site", "PYTHONDONTWRITEBYTECODE": "1"}


def check_sandbox_python(version_output: str) -> None:
    """Raise if ``python3 --version`` in the sandbox is not this interpreter's minor
    version (the copied binary packages would not import)."""
    want = f"Python {sys.version_info.major}.{sys.version_info.minor}."
    if not version_output.strip().startswith(want):
        raise RuntimeError(
            f"the sandbox's python3 is {version_output.strip()!r}; the agent runtime was "
            f"copied from {sys.version.split()[0]} and needs the same minor version")
