"""Find an environment class by name: a registered env, ``path/to/file.py:Class``,
``package.module:Class``, or another framework's env: ``verifiers:ID`` (a verifiers
taskset) or ``openenv:URL`` (an OpenEnv server), see :mod:`environments.adapters`."""

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


ADAPTER_PREFIXES = ("verifiers:", "openenv:")
"""Names of another framework's envs: ``verifiers:ID``, ``openenv:URL``."""


def load_env_class(name: str) -> type[BaseEnv]:
    if name.startswith("verifiers:"):
        from environments.adapters.verifiers_env import verifiers_env_class

        taskset_id = name.removeprefix("verifiers:")
        if not taskset_id:
            raise EnvNotFoundError("verifiers:ID needs the taskset id (an importable module)")
        try:
            return verifiers_env_class(taskset_id)
        except (ImportError, ValueError, TypeError, AttributeError) as error:
            raise EnvNotFoundError(f"{name!r}: {error}") from None
    if name.startswith("openenv:"):
        from environments.adapters.openenv_env import openenv_env_class

        url = name.removeprefix("openenv:")
        if not url.startswith(("http://", "https://")):
            raise EnvNotFoundError(f"{name!r}: openenv:URL needs the server's http(s):// URL")
        return openenv_env_class(url)
    target = ENVIRONMENTS.get(name, name)
    if ":" not in target:
        raise EnvNotFoundError(
            f"unknown environment {name!r}: use one of {', '.join(sorted(ENVIRONMENTS))}, "
            "or path/to/file.py:ClassName, or package.module:ClassName, or verifiers:ID, "
            "or openenv:URL")
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
