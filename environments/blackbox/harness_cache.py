"""The harness cache: each catalog harness (:mod:`environments.blackbox.harnesses`)
installed once from its registry into ``$LACHESIS_HARNESS_CACHE`` or
``~/.cache/lachesis/harnesses`` (root: ``/var/cache/lachesis/harnesses``), one directory
per ``NAME-VERSION``: made in a staging directory under an exclusive lock, checked, made
readable by every uid, marked and renamed into place, so a half-done install is never
used."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from environments.blackbox.harnesses import (
    CACHE_ENV,
    MARKER,
    PYTHON,
    Harness,
    HarnessError,
    node_package,
)

# -- the cache ------------------------------------------------------------------------------
ROOT_CACHE = Path("/var/cache/lachesis/harnesses")
"""The default cache of root: sandboxes of root run under other uids, and root's home is
not theirs to enter."""


def cache_root() -> Path:
    """``$LACHESIS_HARNESS_CACHE``, or ``~/.cache/lachesis/harnesses`` (root:
    :data:`ROOT_CACHE`)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    if os.geteuid() == 0:
        return ROOT_CACHE
    return Path.home() / ".cache" / "lachesis" / "harnesses"


def check_reachable(path: Path) -> None:
    """Raise unless every directory down to ``path`` lets other uids through (x) and
    ``path`` itself is readable by them: as root, bwrap sandboxes run under their own uids
    and cannot mount what those cannot reach."""
    for directory in [path.resolve(), *path.resolve().parents]:
        if not directory.stat().st_mode & 0o001:
            raise HarnessError(f"sandboxes cannot reach the harness install {path}: "
                               f"{directory} is not searchable by others (chmod o+x, or "
                               f"set {CACHE_ENV} to a directory they can reach)")


def install_dir(harness: Harness, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{harness.name}-{harness.version}"


def installed(harness: Harness, root: Path | None = None) -> Path | None:
    """The install directory if the install is complete (its marker is there)."""
    target = install_dir(harness, root)
    return target if (target / MARKER).is_file() else None


def install_commands(harness: Harness, target: Path) -> list[list[str]]:
    """The commands that install ``harness`` into ``target`` (a new directory)."""
    if harness.registry == "npm":
        node = [f"{node_package()}@{harness.node}"] if harness.node else []
        scripts = [[str(target / harness.entry), str(target / script)]
                   for script in harness.node_scripts]
        return [["npm", "install", "--prefix", str(target), "--no-audit", "--no-fund",
                 "--no-update-notifier", *harness.npm_options, harness.spec, *node],
                *scripts]
    return [[PYTHON, "-m", "venv", str(target)],
            [str(target / "bin" / "python"), "-m", "pip", "install", "--no-input",
             "--disable-pip-version-check", harness.spec, *harness.pip_requirements]]


def install_hint(harness: Harness) -> str:
    return f"lachesis harness install {harness.name}"


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive lock on ``path`` (waits up to ``timeout_s``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HarnessError(f"another process has held {path} for over "
                                       f"{timeout_s:g} s (an install in progress?)") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _readable_by_all(root: Path) -> None:
    """Directories a+rx, files a+r (and a+x where the owner may execute): sandboxes run
    under other uids."""
    for directory, dirs, files in os.walk(root):
        os.chmod(directory, os.stat(directory).st_mode | 0o755)
        for name in files:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                continue
            mode = os.stat(path).st_mode
            os.chmod(path, mode | 0o444 | (0o111 if mode & 0o100 else 0))


def install(harness: Harness, root: Path | None = None, *, timeout_s: float = 1800,
            lock_timeout_s: float = 3600, log: Callable[[str], None] | None = None,
            run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Path:
    """The install directory of ``harness`` in the cache, installed first if it is not
    there. Safe to call from several processes at once. :class:`HarnessError` (with the
    failing command and its output's tail) when the install fails."""
    if (done := installed(harness, root)) is not None:
        return done
    root = root or cache_root()
    target = install_dir(harness, root)
    with _locked(root / f".{target.name}.lock", lock_timeout_s):
        if (done := installed(harness, root)) is not None:
            return done  # another process finished it while we waited
        for leftover in root.glob(f".{target.name}.staging-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # a crashed install's
        if target.exists():  # no marker: not ours to trust
            shutil.rmtree(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=root))
        staging.rmdir()  # the install commands make it
        try:
            commands = install_commands(harness, staging)
            started = time.monotonic()
            for command in commands:
                if log:
                    log(f"installing {harness.spec}: {' '.join(command)}")
                try:
                    done_ = run(command, capture_output=True, text=True, timeout=timeout_s)
                except (OSError, subprocess.TimeoutExpired) as error:
                    raise HarnessError(f"installing harness {harness.name} ({harness.spec}) "
                                       f"failed: {' '.join(command)}: {error}") from error
                if done_.returncode != 0:
                    tail = (done_.stdout + done_.stderr).strip()[-2000:]
                    raise HarnessError(
                        f"installing harness {harness.name} ({harness.spec}) failed: "
                        f"{' '.join(command)} exited with {done_.returncode}:\n{tail}")
            entry = staging / harness.entry
            if not (entry.exists() and os.access(entry, os.X_OK)):
                raise HarnessError(f"installing harness {harness.name} ({harness.spec}): "
                                   f"the install has no program {harness.entry}")
            (staging / MARKER).write_text(json.dumps({
                "name": harness.name, "spec": harness.spec, "registry": harness.registry,
                "commands": [[str(a).replace(str(staging), str(target)) for a in c]
                             for c in commands],
                "seconds": round(time.monotonic() - started, 1)}, indent=1) + "\n")
            _readable_by_all(staging)
            staging.rename(target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


