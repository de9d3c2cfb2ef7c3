"""The env kinds Lachesis ships (other frameworks' envs), registered with the env registry.

The same kinds are declared as entry points in ``pyproject.toml`` (group
``lachesis.env_kinds``), where third-party packages add theirs; registering them here as
well keeps them working from a source checkout whose installed metadata predates them.
"""

from __future__ import annotations

from environments.framework import registry

BUILTIN_KINDS = {
    "verifiers": "environments.adapters.verifiers_env:verifiers_env_class",
    "openenv": "environments.adapters.openenv_env:openenv_env_class",
}
"""``KIND: module:function`` (the function takes what follows ``KIND:``)."""


def register_builtin_kinds() -> None:
    for name, target in BUILTIN_KINDS.items():
        registry.register_env_kind(name, target, source="lachesis")


def load_env_class(name: str) -> type:
    """The env class of ``name`` (:func:`environments.framework.registry.load_env_class`)
    with Lachesis's own kinds registered."""
    register_builtin_kinds()
    return registry.load_env_class(name)
