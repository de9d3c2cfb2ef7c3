"""Sandboxes for running untrusted code (what an agent writes) in environments.

    from environments.sandbox import SandboxConfig, create_sandbox

    async with await create_sandbox(SandboxConfig(backend="bwrap", timeout_s=5)) as box:
        await box.write_file("main.py", "print(sum(range(10)))")
        result = await box.exec("python3 main.py")      # ExecResult(exit_code=0, stdout='45\\n', ...)

Backends: ``bwrap`` (bubblewrap; the default), ``docker`` (a container per sandbox) and
``unsafe_subprocess`` (no isolation; needs ``allow_unsafe``). See ``base`` for the API and
the error kinds, each backend's module for what it isolates, ``reaper`` for cleanup after
crashes, ``images`` for the docker image and daemon, ``host`` for the process and file
helpers of the host-side backends. The sandboxes know no env: tools that run in a sandbox
and the env mixin that gives each rollout one are in ``environments.framework.sandbox_tools``.
"""

from __future__ import annotations

from environments.sandbox.base import (
    WORKSPACE,
    ExecResult,
    MissingSystemPackage,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxPathError,
    SandboxUsageError,
    close_all,
    live_sandboxes,
)
from environments.sandbox.reaper import reap

__all__ = [
    "WORKSPACE",
    "ExecResult",
    "MissingSystemPackage",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxPathError",
    "SandboxUsageError",
    "backend_class",
    "close_all",
    "create_sandbox",
    "live_sandboxes",
    "reap",
]


def backend_class(name: str) -> type[Sandbox]:
    if name == "bwrap":
        from environments.sandbox.bwrap import BwrapSandbox
        return BwrapSandbox
    if name == "docker":
        from environments.sandbox.docker import DockerSandbox
        return DockerSandbox
    if name == "unsafe_subprocess":
        from environments.sandbox.unsafe import UnsafeSubprocessSandbox
        return UnsafeSubprocessSandbox
    raise ValueError(f"unknown sandbox backend {name!r}: use bwrap, docker or unsafe_subprocess")


async def create_sandbox(config: SandboxConfig | None = None, **overrides) -> Sandbox:
    """A new sandbox of ``config.backend`` (``overrides`` replace config fields)."""
    config = config or SandboxConfig()
    if overrides:
        config = config.model_copy(update=overrides)
        config = SandboxConfig.model_validate(config.model_dump())
    return await backend_class(config.backend).create(config)
