"""The ``bwrap`` backend: bubblewrap, unprivileged, one host directory per sandbox.

Every ``exec`` is a fresh ``bwrap`` process with all namespaces unshared (user, pid,
network, ipc, uts, cgroup, mount): no network but loopback (unless ``network``), the host's
/usr (and the /bin, /lib... links) read-only, a made-up /etc, a private /tmp tmpfs, its own
/proc, and the sandbox's workspace read-write at /workspace. The workspace persists from
one exec to the next; processes do not: when the command exits, bwrap's pid-1 exits and
the kernel kills everything left in the pid namespace (``sleep 1000 &`` included), and a
killed command (timeout, output limit, ``close()``) takes its whole namespace with it.

``--die-with-parent``: if the process that owns the sandbox dies (even ``kill -9``), its
running commands die with it; only the workspace directory is left, for the reaper.

Limits are rlimits set by ``prlimit`` on the bwrap process and inherited by the command:
CPU seconds, address space, file size, processes, no core dumps. When this process is root,
each sandbox runs under its own unprivileged host uid (picked at random in a high range), so
the process limit counts that sandbox alone, the sandbox cannot signal or read anything
the host's root owns, and two sandboxes never share a uid in practice.

Host-side file operations (``write_file`` / ``read_file``) walk the workspace one
component at a time with ``O_NOFOLLOW`` relative to directory descriptors, so a symlink
or hard link the agent planted cannot redirect them outside the workspace, and they run
while no command of the sandbox runs (calls on a sandbox are serialized).
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import shutil
import stat
import time
import weakref
from pathlib import Path

from environments.sandbox.base import (
    SANDBOX_UID,
    WORKSPACE,
    ExecResult,
    Sandbox,
    SandboxConfig,
    MissingSystemPackage,
    SandboxError,
    SandboxPathError,
    SandboxUsageError,
    default_workspace_root,
    owner_tag,
)
from environments.sandbox.host import (
    cleanup_workspace,
    kill_pids,
    remove_tree,
    run_process,
    user_task_count,
)
from environments.sandbox.reaper import reap_workspaces

UID_BASE = 1_000_000
"""Host uids given to sandboxes when running as root: [UID_BASE, UID_BASE + UID_SPAN)."""
UID_SPAN = 1 << 24
_TMP_MB = 64
"""Size of each exec's private /tmp."""

_PASSWD = ("root:x:0:0:root:/:/usr/sbin/nologin\n"
           f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{WORKSPACE}:/bin/sh\n"
           "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"
_HOSTS = "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def _check_traversable(root: Path) -> None:
    """As root, sandboxes run under other uids: every directory above their workspace must
    let others through (x), or bwrap cannot bind it."""
    for directory in [root.resolve(), *root.resolve().parents]:
        if not directory.stat().st_mode & 0o001:
            raise SandboxError(f"sandbox uids cannot reach workspaces in {root}: {directory} "
                               "is not searchable by others (chmod o+x, or pick another "
                               "workspace_root)")


class BwrapSandbox(Sandbox):
    backend = "bwrap"
    _probed = False

    @classmethod
    def reap_leftovers(cls, config: SandboxConfig) -> None:
        reap_workspaces(config.workspace_root)

    async def _start(self) -> None:
        self._bwrap = shutil.which("bwrap")
        self._prlimit = shutil.which("prlimit")
        if self._bwrap is None:
            raise MissingSystemPackage("bwrap", "bubblewrap")
        if self._prlimit is None:
            raise MissingSystemPackage("prlimit", "util-linux")
        root = Path(self.config.workspace_root or default_workspace_root())
        root.mkdir(parents=True, exist_ok=True)
        if root.stat().st_uid == os.geteuid():
            root.chmod(0o711)  # sandbox uids traverse it, nobody lists it
        self.dir = root / f"{owner_tag()}-{self.id}"
        self.dir.mkdir(mode=0o711)
        self._resources = {"dir": self.dir, "pids": set()}
        self._finalizer = weakref.finalize(self, cleanup_workspace, self._resources)
        self.workspace = self.dir / "workspace"
        self.workspace.mkdir(mode=0o700)
        etc = self.dir / "etc"
        etc.mkdir(mode=0o755)
        for name, text in (("passwd", _PASSWD), ("group", _GROUP), ("hosts", _HOSTS),
                           ("hostname", "sandbox\n")):
            (etc / name).write_text(text)
            (etc / name).chmod(0o644)
        if os.geteuid() == 0:
            _check_traversable(root)
            self.uid = self.gid = UID_BASE + random.randrange(UID_SPAN)
            os.chown(self.workspace, self.uid, self.gid)
            nproc = self.config.max_processes
        else:
            self.uid = self.gid = None
            nproc = await asyncio.to_thread(user_task_count, os.geteuid())
            nproc += self.config.max_processes
        self._nproc = nproc + 2  # the two bwrap processes (outside, and PID 1 inside)
        self._mounts = self._mount_args()
        if not BwrapSandbox._probed:
            result = await self._exec(["/bin/true"], 30.0, {}, WORKSPACE)
            if result.exit_code != 0:
                raise SandboxError(f"bwrap cannot start a sandbox here (exit {result.exit_code}): "
                                   f"{result.stderr.strip()}")
            BwrapSandbox._probed = True

    def _mount_args(self) -> list[str]:
        args: list[str] = []
        for path in self.config.ro_binds:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                args += ["--ro-bind", path, path]
        for host, inside in self.config.ro_mounts.items():
            args += ["--ro-bind", host, inside]
        return args + [
            "--ro-bind", str(self.dir / "etc"), "/etc",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(_TMP_MB << 20), "--perms", "1777", "--tmpfs", "/tmp",
            "--bind", str(self.workspace), WORKSPACE,
            "--remount-ro", "/",  # bwrap's root tmpfs: nothing but /tmp and /workspace is writable
        ]

    def _command(self, argv: list[str], env: dict[str, str], workdir: str) -> list[str]:
        c = self.config
        limits = [self._prlimit, f"--cpu={c.cpu_time_s}", f"--as={c.memory_mb << 20}",
                  f"--fsize={c.max_file_mb << 20}", f"--nproc={self._nproc}", "--core=0",
                  "--"]
        sandbox = [self._bwrap, "--unshare-all", "--die-with-parent", "--new-session",
                   "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                   "--hostname", "sandbox", "--cap-drop", "ALL", "--clearenv"]
        if c.network:
            sandbox.append("--share-net")
        for key, value in {**self._base_env(), **env}.items():
            sandbox += ["--setenv", key, value]
        return [*limits, *sandbox, *self._mounts, "--chdir", workdir, "--", *argv]

    async def _exec(self, argv: list[str], timeout_s: float, env: dict[str, str],
                    workdir: str) -> ExecResult:
        command = self._command(argv, env, workdir)
        user = {} if self.uid is None else {"user": self.uid, "group": self.gid,
                                            "extra_groups": []}
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True,
                env={"PATH": "/usr/bin:/bin"}, **user)
        except OSError as error:
            raise SandboxError(f"could not start bwrap: {error}") from error
        result = await run_process(proc, self._resources["pids"], timeout_s,
                                   self.config.max_output_bytes, started)
        if result.exit_code is not None and result.exit_code != 0 and argv != ["/bin/true"]:
            self._check_bwrap_failure(result)
        result.workspace_over_quota = await asyncio.to_thread(self._over_quota)
        return result

    @staticmethod
    def _check_bwrap_failure(result: ExecResult) -> None:
        # bwrap reports its own failures (mounts, namespaces) as "bwrap: ..." with exit 1.
        if result.exit_code == 1 and result.stderr.startswith("bwrap: "):
            if result.stderr.startswith("bwrap: Can't chdir"):
                raise SandboxUsageError(result.stderr.strip().removeprefix("bwrap: "))
            raise SandboxError(f"bwrap failed: {result.stderr.strip()}")

    def _over_quota(self) -> bool:
        limit = self.config.workspace_mb << 20
        total = 0
        stack = [str(self.workspace)]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += info.st_blocks * 512
                if stat.S_ISDIR(info.st_mode):
                    stack.append(entry.path)
                if total > limit:
                    return True
        return False

    # -- files: walk with O_NOFOLLOW from the workspace's descriptor -----------------------
    def _open_parent(self, relative: str, create: bool) -> tuple[int, str]:
        """(descriptor of the parent directory of ``relative``, final name)."""
        *parents, name = relative.split("/")
        fd = os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for part in parents:
                try:
                    next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                      dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if self.uid is not None:
                        os.chown(part, self.uid, self.gid, dir_fd=fd, follow_symlinks=False)
                    next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                      dir_fd=fd)
                except OSError as error:
                    if error.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise SandboxPathError(f"{relative}: {part!r} is a symlink or not a "
                                               "directory") from None
                    raise
                os.close(fd)
                fd = next_fd
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    def _open_file(self, relative: str, flags: int, mode: int = 0o644) -> int:
        parent, name = self._open_parent(relative, create=bool(flags & os.O_CREAT))
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=parent)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise SandboxPathError(f"{relative} is a symlink") from None
            if error.errno == errno.ENXIO:
                raise SandboxPathError(f"{relative} is not a regular file") from None
            raise
        finally:
            os.close(parent)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            os.close(fd)
            raise SandboxPathError(f"{relative} is not a regular file (or has other links)")
        return fd

    def _write_sync(self, relative: str, data: bytes, mode: int) -> None:
        if self._over_quota():
            raise SandboxUsageError(f"the workspace is over its {self.config.workspace_mb} MB "
                                    "quota; remove files first")
        fd = self._open_file(relative, os.O_WRONLY | os.O_CREAT, mode)
        try:
            os.ftruncate(fd, 0)
            if self.uid is not None:
                os.fchown(fd, self.uid, self.gid)
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def _read_sync(self, relative: str, limit: int) -> bytes:
        fd = self._open_file(relative, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise SandboxUsageError(f"{relative} is {size} bytes, over the {limit}-byte "
                                        "read limit")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)[:limit]
        finally:
            os.close(fd)

    async def _write(self, relative: str, data: bytes, mode: int) -> None:
        await asyncio.to_thread(self._write_sync, relative, data, mode)

    async def _read(self, relative: str, limit: int) -> bytes:
        return await asyncio.to_thread(self._read_sync, relative, limit)

    async def _close(self) -> None:
        resources = getattr(self, "_resources", None)
        if resources is None:
            return
        kill_pids(resources["pids"])
        await asyncio.to_thread(remove_tree, resources["dir"])


