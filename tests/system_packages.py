"""The system packages the suite needs, and what a test does when one is missing.

`make test` installs them first (`make system-deps`, scripts/system-deps). On a machine
where that could not be done (no root, no sudo, no apt), a test that needs a missing
package is skipped, and the reason names the package: either up front, by its marker
(``@pytest.mark.needs("bubblewrap")``; the sandbox tests' ``bwrap``/``docker``
parameters and the ``docker_image`` fixture add theirs), or when the code under test
raises :class:`~environments.sandbox.MissingSystemPackage` (the sandboxes check for
their programs when they start). Each session ends with a list of the packages it
missed and how many tests each one skipped. A skipped test is not a passed one: pytest
counts it apart ("N passed, M skipped").

``LACHESIS_REQUIRE_SYSTEM_PACKAGES=1`` (`.ci/run` sets it) turns those skips into
failures: CI must run every test. Loaded by tests/conftest.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter

import pytest

STRICT_ENV = "LACHESIS_REQUIRE_SYSTEM_PACKAGES"


def _program(*names: str):
    return lambda: any(shutil.which(n) for n in names)


def _docker() -> bool:
    if shutil.which("dockerd"):
        return True
    from environments.sandbox.images import docker_ping

    return docker_ping()  # a daemon of another machine's (DOCKER_HOST)


def _host_python_venv() -> bool:
    python = "/usr/bin/python3"
    return os.access(python, os.X_OK) and subprocess.run(
        [python, "-c", "import ensurepip, venv"], capture_output=True).returncode == 0


PACKAGES = {
    # Debian package: (is it here?, what needs it)
    "bubblewrap": (_program("bwrap"), "the bwrap sandbox backend"),
    "util-linux": (_program("prlimit"), "the sandboxes' limits (prlimit)"),
    "docker.io": (_docker, "the docker sandbox backend"),
    "debootstrap": (_program("debootstrap"), "building the docker sandbox image"),
    "chromium": (_program("chromium", "chromium-browser"), "the HTML report's browser test"),
    "nodejs": (_program("node"), "the npm harnesses (Pi, OpenCode, Codex, Claude Code)"),
    "npm": (_program("npm"), "installing the npm harnesses"),
    "python3-venv": (_host_python_venv, "venvs of /usr/bin/python3 (pip harnesses)"),
}
"""The same list as scripts/system-deps (which installs them)."""

# what a test's parameters say it needs
# (debootstrap only where the image must be built: the sandbox code says so when it must)
PARAMETERS = {"bwrap": ("bubblewrap", "util-linux"), "docker": ("docker.io",)}


def strict() -> bool:
    return os.environ.get(STRICT_ENV) == "1"


def missing(package: str) -> bool:
    if package not in PACKAGES:
        raise ValueError(f"unknown system package {package!r}: one of {sorted(PACKAGES)}")
    return not PACKAGES[package][0]()


def reason(package: str, detail: str = "") -> str:
    return (f"needs the system package {package} ({PACKAGES[package][1]}), not installed"
            + (f": {detail}" if detail else "") + " (`make system-deps` installs it)")


def _missing_package_error(error: BaseException | None):
    from environments.sandbox import MissingSystemPackage

    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, MissingSystemPackage):
            return e
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


class SystemPackages:
    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()
        self._cache: dict[str, bool] = {}

    def _missing(self, package: str) -> bool:
        if package not in self._cache:
            self._cache[package] = missing(package)
        return self._cache[package]

    def pytest_collection_modifyitems(self, items):
        for item in items:
            callspec = getattr(item, "callspec", None)
            params = {str(v) for v in callspec.params.values()} if callspec else set()
            needed = [p for param in params & set(PARAMETERS) for p in PARAMETERS[param]]
            if "docker_image" in getattr(item, "fixturenames", ()):
                needed += PARAMETERS["docker"]
            if needed:
                item.add_marker(pytest.mark.needs(*sorted(set(needed))))
            for mark in item.iter_markers("needs"):
                for package in mark.args:
                    if package not in PACKAGES:
                        raise ValueError(f"{item.nodeid}: unknown system package {package!r}"
                                         f" in @pytest.mark.needs: one of {sorted(PACKAGES)}")
                    # (strict: the test runs, and fails on what is missing)
                    if not strict() and self._missing(package):
                        item.add_marker(pytest.mark.skip(reason=reason(package)))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.skipped and isinstance(report.longrepr, tuple):
            for package in PACKAGES:
                if f"needs the system package {package} " in str(report.longrepr[2]):
                    self.skipped[package] += 1
            return
        if not report.failed or call.excinfo is None or strict():
            return
        error = _missing_package_error(call.excinfo.value)
        if error is None:
            return
        # the code under test found a program missing: a skip that names its package
        package = error.package if error.package in PACKAGES else None
        text = reason(package) if package else (
            f"needs the system package {error.package}: {error}")
        path, line, _ = item.location
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (line or 0) + 1, text)
        self.skipped[error.package] += 1

    def pytest_terminal_summary(self, terminalreporter):
        if not self.skipped:
            return
        terminalreporter.section("tests skipped for missing system packages (not passed)")
        for package, count in sorted(self.skipped.items()):
            what = PACKAGES[package][1] if package in PACKAGES else ""
            terminalreporter.write_line(f"{count:4d} skipped: no {package} ({what})")
        terminalreporter.write_line("`make system-deps` installs them (as root or through "
                                    "sudo); then `make test` runs these tests too")


def register(config) -> None:
    if config.pluginmanager.has_plugin("lachesis-system-packages"):
        return
    config.addinivalue_line("markers", "needs(*packages): the Debian packages the test "
                            "needs (tests/system_packages.py); it skips without them")
    config.pluginmanager.register(SystemPackages(), "lachesis-system-packages")


def pytest_configure(config):  # (as a plugin of its own: `pytest -p system_packages`)
    register(config)
