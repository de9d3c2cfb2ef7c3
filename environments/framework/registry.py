"""Find an environment class by name: a registered env, ``path/to/file.py:Class`` or
``package.module:Class``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from environments.framework.base import BaseEnv

ENVIRONMENTS = {
    "arithmetic_tool": "environments.envs.arithmetic_tool:ArithmeticToolEnv",
    "code_debug": "environments.envs.code_debug:CodeDebugEnv",
    "gsm8k_code": "environments.envs.gsm8k_code:GSM8KCodeEnv",
    "swe_fix": "environments.envs.swe_fix:SweFixEnv",
}
"""Envs shipped with Lachesis, by name."""


class EnvNotFoundError(LookupError):
    pass


def load_env_class(name: str) -> type[BaseEnv]:
    target = ENVIRONMENTS.get(name, name)
    if ":" not in target:
        raise EnvNotFoundError(
            f"unknown environment {name!r}: use one of {', '.join(sorted(ENVIRONMENTS))}, "
            "or path/to/file.py:ClassName, or package.module:ClassName")
    where, _, class_name = target.rpartition(":")
    if where.endswith(".py") or "/" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise EnvNotFoundError(f"{name!r}: no such file {path}")
        module_name = f"lachesis_user_env_{abs(hash(str(path)))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling need it registered
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            raise EnvNotFoundError(f"{name!r}: cannot import {where!r} ({error})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise EnvNotFoundError(f"{name!r}: {where} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, BaseEnv)):
        raise EnvNotFoundError(f"{name!r}: {class_name} is not a subclass of BaseEnv")
    return cls
