"""Env kinds are plugins: an installed package adds ``KIND:SPEC`` names through the
``lachesis.env_kinds`` entry-point group, and the env framework finds Lachesis's own kinds
(other frameworks' envs) the same way, without importing them.

The packages here are installed the way pip leaves them: a module and its
``NAME.dist-info`` (METADATA, entry_points.txt) on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

from environments.framework import registry
from environments.framework.registry import EnvNotFoundError


def install(site: Path, dist: str, kinds: dict[str, str], module: str | None = None,
            code: str = "") -> None:
    """A distribution ``dist`` in ``site`` that declares ``kinds`` (name: module:function)
    and holds ``module`` (its source ``code``)."""
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[lachesis.env_kinds]\n" + "".join(f"{k} = {v}\n" for k, v in kinds.items()))
    if module:
        (site / f"{module}.py").write_text(textwrap.dedent(code))


REVERSED = """
    from environments.envs.arithmetic_tool import ArithmeticToolEnv

    def env_class(spec):
        if not spec.isdigit():
            raise ValueError(f"rev:N needs a number, not {spec!r}")
        return type("Rev", (ArithmeticToolEnv,), {"name": f"rev-{spec}"})
"""


def test_an_installed_package_adds_an_env_kind(tmp_path, monkeypatch):
    install(tmp_path, "rev_kind", {"rev": "rev_kind_module:env_class"}, "rev_kind_module",
            REVERSED)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.env_kinds()["rev"].source == "entry point of rev_kind"
    cls = registry.load_env_class("rev:7")
    assert cls.name == "rev-7" and cls.config_class().group_size >= 1
    with pytest.raises(EnvNotFoundError, match="'rev:x': rev:N needs a number"):
        registry.load_env_class("rev:x")
    # A name that is no kind is still a module path, and the error lists the kinds.
    with pytest.raises(EnvNotFoundError, match=r"cannot import 'nokind'.*kinds known: .*rev"):
        registry.load_env_class("nokind:Env")

    # The CLI finds it too (a separate process, the package on its path): the env's
    # settings become flags, and the help names the kind.
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "lachesis.cli", "env", "serve", "rev:3",
                           "--help"], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "lachesis env serve rev:3" in done.stdout and "--group-size" in done.stdout
    done = subprocess.run([sys.executable, "-m", "lachesis.cli", "env", "--help"], cwd=REPO,
                          env=environ, capture_output=True, text=True, timeout=120)
    assert "rev:... (installed env kind)" in done.stdout


def test_broken_or_clashing_kinds_say_which_package(tmp_path, monkeypatch):
    install(tmp_path, "one_dist", {"twice": "one_module:env_class",
                                   "broken": "missing_module:env_class"})
    install(tmp_path, "other_dist", {"twice": "other_module:env_class"})
    install(tmp_path, "notenv_dist", {"notenv": "notenv_module:env_class"}, "notenv_module",
            "def env_class(spec):\n    return dict\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvNotFoundError, match=r"declared by several packages "
                       r"\(entry point of (one|other)_dist, entry point of (other|one)_dist\)"):
        registry.load_env_class("twice:x")
    with pytest.raises(EnvNotFoundError, match=r"env kind 'broken' \(entry point of one_dist\): "
                       r"cannot load missing_module:env_class"):
        registry.load_env_class("broken:x")
    with pytest.raises(EnvNotFoundError, match="gave <class 'dict'>, not a subclass of BaseEnv"):
        registry.load_env_class("notenv:x")


def test_a_registered_kind_wins_and_kind_names_cannot_look_like_modules(monkeypatch):
    from environments.envs.arithmetic_tool import ArithmeticToolEnv

    monkeypatch.setattr(registry, "_REGISTERED", {})
    registry.register_env_kind("openenv", lambda spec: ArithmeticToolEnv)
    assert registry.load_env_class("openenv:anything") is ArithmeticToolEnv
    for bad in ("my.kind", "a/b", "", "1kind"):
        with pytest.raises(ValueError, match="use letters"):
            registry.register_env_kind(bad, lambda spec: ArithmeticToolEnv)


def test_the_builtin_kinds_come_from_the_front_door_and_the_package_metadata():
    """The framework imports no adapter (tests/test_layers.py); the front door registers
    Lachesis's kinds, and pyproject.toml declares the same ones as entry points."""
    import tomllib

    from lachesis.env_kinds import BUILTIN_KINDS, load_env_class

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "entry-points"][registry.ENTRY_POINT_GROUP]
    assert declared == BUILTIN_KINDS
    assert load_env_class("openenv:http://127.0.0.1:1/").name == "openenv-127.0.0.1_1"
