"""`make system-deps` (scripts/system-deps) where it cannot install, and what a test whose
system package is missing does (tests/system_packages.py): it skips naming the package,
the session says so at its end, and under LACHESIS_REQUIRE_SYSTEM_PACKAGES=1 it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "system-deps"


def bare_path(tmp_path: Path, *programs: str) -> str:
    """A PATH with only ``programs`` (and what the script itself runs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "id", "python3", *programs):
        found = shutil.which(name)
        if found:
            (bin_dir / name).symlink_to(found)
    return str(bin_dir)


def system_deps(path: str, *args: str, strict: bool = False, user: int | None = None):
    env = {"PATH": path, "HOME": "/tmp"}
    if strict:
        env["LACHESIS_REQUIRE_SYSTEM_PACKAGES"] = "1"
    command = ["bash", str(SCRIPT), *args]
    if user is not None:
        command = [shutil.which("setpriv"), f"--reuid={user}", f"--regid={user}",
                   "--clear-groups", *command]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def test_without_apt_it_names_what_is_missing_and_the_tests_go_on(tmp_path):
    path = bare_path(tmp_path)
    done = system_deps(path)
    assert done.returncode == 0, done.stderr
    assert "no apt-get on this machine" in done.stderr
    for package in ("bubblewrap", "docker.io", "debootstrap", "chromium", "npm", "make"):
        assert package in done.stderr
    assert "install them with: sudo apt-get install" in done.stderr
    assert "the tests that need them skip" in done.stderr
    check = system_deps(path, "--check")
    assert check.returncode == 1 and "missing" in check.stdout and "bubblewrap" in check.stdout


def test_ci_stops_where_a_package_cannot_be_installed(tmp_path):
    done = system_deps(bare_path(tmp_path), strict=True)
    assert done.returncode == 1
    assert "LACHESIS_REQUIRE_SYSTEM_PACKAGES=1: stopping" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="runs the script as another user: needs root and setpriv")
def test_not_root_and_no_sudo_is_said_and_nothing_is_run():
    import tempfile

    with tempfile.TemporaryDirectory() as where:  # (one that user nobody can reach)
        os.chmod(where, 0o755)
        # apt-get there, but neither root nor sudo
        path = bare_path(Path(where), "apt-get")
        done = system_deps(path, user=65534)  # nobody
        assert done.returncode == 0, done.stderr
        assert "not root, and no password-less sudo" in done.stderr, done.stderr
        assert "system-deps: apt-get install" not in done.stdout


INNER = '''
import pytest
from environments.sandbox import MissingSystemPackage

def test_a_sandbox_without_its_program():
    raise MissingSystemPackage("bwrap", "bubblewrap")

def test_an_error_that_wraps_it():
    try:
        raise MissingSystemPackage("dockerd", "docker.io", "no docker daemon answers")
    except MissingSystemPackage as error:
        raise RuntimeError("the env failed to start") from error

def test_another_failure():
    assert 1 == 2

def test_a_pass():
    pass
'''


def inner_session(tmp_path: Path, strict: bool = False, body: str = INNER):
    (tmp_path / "test_inner.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    env.pop("LACHESIS_REQUIRE_SYSTEM_PACKAGES", None)
    if strict:
        env["LACHESIS_REQUIRE_SYSTEM_PACKAGES"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "system_packages", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_missing_package_is_a_skip_that_names_it_and_never_a_pass(tmp_path):
    done = inner_session(tmp_path)
    out = done.stdout
    assert done.returncode == 1, out  # the other failure still fails the session
    assert "1 failed, 1 passed, 2 skipped" in out, out[-2000:]
    assert "needs the system package bubblewrap" in out
    assert "needs the system package docker.io" in out
    assert "tests skipped for missing system packages (not passed)" in out
    assert "1 skipped: no bubblewrap" in out and "1 skipped: no docker.io" in out


def test_under_the_ci_flag_a_missing_package_fails(tmp_path):
    done = inner_session(tmp_path, strict=True)
    assert "3 failed, 1 passed" in done.stdout, done.stdout[-2000:]
    assert "MissingSystemPackage" in done.stdout


def test_an_unknown_package_in_a_needs_marker_is_a_clear_error(tmp_path):
    done = inner_session(tmp_path, body='import pytest\n\n@pytest.mark.needs("bwrap")\n'
                                        'def test_x():\n    pass\n')
    assert done.returncode != 0
    assert "unknown system package 'bwrap'" in done.stdout + done.stderr
