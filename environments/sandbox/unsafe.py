"""The ``unsafe_subprocess`` backend: plain subprocesses in a temporary directory.

No isolation at all: commands run as this process's user, see its whole filesystem and
its network. Only rlimits (CPU, memory, file size, processes) and the exec timeout and
output limit apply, and the command's process group is killed at the end. It exists for
machines where neither bubblewrap nor Docker can run, for trusted code only, and refuses
to start unless ``allow_unsafe`` is set. ``/workspace`` in paths and in ``cwd`` means the
temporary directory; commands see its real path (``$HOME`` and the working directory).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import weakref
from pathlib import Path

from environments.sandbox.base import (
    WORKSPACE,
    ExecResult,
    MissingSystemPackage,
    SandboxError,
    SandboxUsageError,
    default_workspace_root,
    owner_tag,
)
from environments.sandbox.bwrap import BwrapSandbox
from environments.sandbox.host import cleanup_workspace, run_process, user_task_count


class UnsafeSubprocessSandbox(BwrapSandbox):
    backend = "unsafe_subprocess"

    async def _start(self) -> None:
        if not self.config.allow_unsafe:
            raise SandboxUsageError("backend unsafe_subprocess runs commands without any "
                                    "isolation; set allow_unsafe: true to use it")
        if self.config.ro_mounts:
            raise SandboxUsageError("backend unsafe_subprocess cannot mount directories "
                                    f"(ro_mounts: {sorted(self.config.ro_mounts)})")
        self._prlimit = shutil.which("prlimit")
        if self._prlimit is None:
            raise MissingSystemPackage("prlimit", "util-linux")
        root = Path(self.config.workspace_root or default_workspace_root())
        root.mkdir(parents=True, exist_ok=True)
        self.dir = root / f"{owner_tag()}-{self.id}"
        self.dir.mkdir(mode=0o700)
        self._resources = {"dir": self.dir, "pids": set()}
        self._finalizer = weakref.finalize(self, cleanup_workspace, self._resources)
        self.workspace = self.dir / "workspace"
        self.workspace.mkdir(mode=0o700)
        self.uid = self.gid = None
        self._nproc = (await asyncio.to_thread(user_task_count, os.geteuid())
                       + self.config.max_processes)

    def _host_dir(self, workdir: str) -> str:
        return str(self.workspace) + workdir[len(WORKSPACE):]

    async def _exec(self, argv: list[str], timeout_s: float, env: dict[str, str],
                    workdir: str) -> ExecResult:
        c = self.config
        command = [self._prlimit, f"--cpu={c.cpu_time_s}", f"--as={c.memory_mb << 20}",
                   f"--fsize={c.max_file_mb << 20}", f"--nproc={self._nproc}", "--core=0",
                   "--", *argv]
        environment = {**self._base_env(), "HOME": str(self.workspace), **env}
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *command, cwd=self._host_dir(workdir), env=environment,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except FileNotFoundError as error:
            raise SandboxUsageError(f"no such directory: {workdir}") from error
        except OSError as error:
            raise SandboxError(f"could not start the command: {error}") from error
        result = await run_process(proc, self._resources["pids"], timeout_s,
                                   c.max_output_bytes, started)
        result.workspace_over_quota = await asyncio.to_thread(self._over_quota)
        return result
