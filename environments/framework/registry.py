"""Find an environment class by name: a registered env, ``path/to/file.py:Class``,
``package.module:Class``, or an env of another kind, ``KIND:SPEC`` (``verifiers:ID``,
``openenv:URL``, ...).

Env kinds are plugins. A kind is a function ``SPEC -> BaseEnv subclass``, found under its
name in the Python entry-point group ``lachesis.env_kinds``, so that any installed package
can add one::

    [project.entry-points."lachesis.env_kinds"]
    mykind = "mypackage.lachesis_kind:env_class"     # lachesis env serve mykind:SPEC

or registered at run time with :func:`register_env_kind`. The framework imports no kind
itself: Lachesis's own kinds (the adapters of other frameworks, ``environments.adapters``)
are registered by the front door (``lachesis``) and also declared as entry points.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from environments.framework.base import BaseEnv

ENVIRONMENTS = {
    "answer_file": "environments.envs.answer_file:AnswerFileEnv",
    "arithmetic_tool": "environments.envs.arithmetic_tool:ArithmeticToolEnv",
    "code_debug": "environments.envs.code_debug:CodeDebugEnv",
    "gsm8k_code": "environments.envs.gsm8k_code:GSM8KCodeEnv",
    "swe_fix": "environments.envs.swe_fix:SweFixEnv",
    "textworld_cooking": "environments.envs.textworld_cooking:TextWorldCookingEnv",
    "wiki_search": "environments.envs.wiki_search:WikiSearchEnv",
}
"""Envs shipped with Lachesis, by name."""

ENTRY_POINT_GROUP = "lachesis.env_kinds"
"""The entry-point group of env kinds: name ``KIND``, value ``module:function``."""

EnvKindLoader = Callable[[str], type[BaseEnv]]


class EnvNotFoundError(LookupError):
    pass


@dataclass(frozen=True)
class EnvKind:
    """One env kind: ``KIND:SPEC`` names are resolved by ``target`` (a function of SPEC, or
    its ``module:function`` path), which ``source`` declared."""

    name: str
    target: EnvKindLoader | str
    source: str

    def loader(self) -> EnvKindLoader:
        if callable(self.target):
            return self.target
        module, _, function = self.target.partition(":")
        try:
            loader = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as error:
            raise EnvNotFoundError(f"env kind {self.name!r} ({self.source}): cannot load "
                                   f"{self.target} ({error})") from None
        if not callable(loader):
            raise EnvNotFoundError(f"env kind {self.name!r} ({self.source}): {self.target} "
                                   "is not a function")
        return loader


_REGISTERED: dict[str, EnvKind] = {}
KIND_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def register_env_kind(name: str, target: EnvKindLoader | str, *,
                      source: str = "registered") -> None:
    """Resolve ``name:SPEC`` with ``target(SPEC)`` (a function or its ``module:function``
    path, imported when first used). A kind registered here wins over an entry point of
    the same name."""
    if not KIND_NAME.fullmatch(name):
        raise ValueError(f"env kind {name!r}: use letters, digits, '_' and '-', starting with "
                         "a letter (no '.' or '/': those name modules and files)")
    _REGISTERED[name] = EnvKind(name, target, source)


def env_kinds() -> dict[str, EnvKind]:
    """Every known env kind: the registered ones and the installed packages' entry points
    (read afresh, so a package installed meanwhile counts)."""
    kinds: dict[str, EnvKind] = {}
    clashes: dict[str, list[str]] = {}
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(point, "dist", None)
        source = f"entry point of {dist.name if dist is not None else 'an installed package'}"
        if not KIND_NAME.fullmatch(point.name):
            continue  # a name that could not be told from a module path
        if point.name in kinds and kinds[point.name].target != point.value:
            clashes.setdefault(point.name, [kinds[point.name].source]).append(source)
        kinds[point.name] = EnvKind(point.name, point.value, source)
    for name, sources in clashes.items():
        if name not in _REGISTERED:
            kinds[name] = EnvKind(name, _clash(name, sources), " and ".join(sources))
    return {**kinds, **_REGISTERED}


def _clash(name: str, sources: list[str]) -> EnvKindLoader:
    def loader(spec: str) -> type[BaseEnv]:
        raise EnvNotFoundError(f"env kind {name!r} is declared by several packages "
                               f"({', '.join(sources)}): uninstall all but one")
    return loader


def names_help() -> str:
    """What an env name may be, for error messages and ``--help``."""
    kinds = sorted(env_kinds())
    return (f"one of {', '.join(sorted(ENVIRONMENTS))}, or path/to/file.py:ClassName, or "
            "package.module:ClassName"
            + "".join(f", or {k}:..." for k in kinds))


def load_env_class(name: str) -> type[BaseEnv]:
    kind_name, colon, spec = name.partition(":")
    kind = env_kinds().get(kind_name) if colon else None
    if kind is not None:
        return _load_kind(name, kind, spec)
    cls = load_target(name)
    if not (isinstance(cls, type) and issubclass(cls, BaseEnv)):
        raise EnvNotFoundError(f"{name!r}: {name.rpartition(':')[2]} is not a subclass of "
                               "BaseEnv")
    return cls


def load_target(name: str) -> object:
    """What a registered env name, ``path/to/file.py:Name`` or ``package.module:Name``
    names (any object: :func:`load_env_class` checks it is an env class)."""
    target = ENVIRONMENTS.get(name, name)
    if ":" not in target:
        raise EnvNotFoundError(f"unknown environment {name!r}: use {names_help()}")
    where, _, class_name = target.rpartition(":")
    if where.endswith(".py") or "/" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise EnvNotFoundError(f"{name!r}: no such file {path}")
        module_name = f"lachesis_user_env_{abs(hash(str(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # dataclasses and pickling need it registered
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            raise EnvNotFoundError(f"{name!r}: cannot import {where!r} ({error}); env kinds "
                                   f"known: {', '.join(sorted(env_kinds())) or 'none'}") from None
    found = getattr(module, class_name, None)
    if found is None:
        raise EnvNotFoundError(f"{name!r}: {where} has no {class_name!r}")
    return found


def _load_kind(name: str, kind: EnvKind, spec: str) -> type[BaseEnv]:
    loader = kind.loader()
    try:
        cls = loader(spec)
    except EnvNotFoundError as error:
        raise EnvNotFoundError(f"{name!r}: {error}") from None
    except (ImportError, ValueError, TypeError, AttributeError, OSError) as error:
        raise EnvNotFoundError(f"{name!r}: {error}") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseEnv)):
        raise EnvNotFoundError(f"{name!r}: env kind {kind.name!r} ({kind.source}) gave "
                               f"{cls!r}, not a subclass of BaseEnv")
    return cls
