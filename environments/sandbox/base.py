"""The sandbox interface shared by every backend, its settings and its errors.

A sandbox is one isolated workspace (``/workspace``) where commands run under limits::

    async with await create_sandbox(SandboxConfig(backend="bwrap")) as box:
        await box.write_file("main.py", "print(6 * 7)")
        result = await box.exec("python3 main.py", timeout_s=5)
        result.exit_code, result.stdout          # 0, "42\\n"

Paths given to ``write_file`` / ``read_file`` / ``upload`` / ``download`` are relative to
the workspace (``/workspace/x`` is accepted too); anything that leaves it is refused with
:class:`SandboxPathError`.

Two kinds of failure are kept apart, because an environment must treat them differently:

* :class:`SandboxUsageError` (and ``FileNotFoundError``): the request was wrong or over a
  limit (a path outside the workspace, a file too large). It is the agent's doing: show
  it to the model.
* :class:`SandboxError`: the sandbox itself failed (could not start, the daemon went
  away, a command could not be run). It is nobody's answer: an environment fails the
  rollout and counts it; it must never score it.

What a command did wrong (non-zero exit, a timeout, too much output) is not an error at
all: it is in the :class:`ExecResult`.
"""

from __future__ import annotations

import signal

import abc
import asyncio
import logging
import os
import posixpath
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

LABEL = "lachesis.sandbox"
"""Docker label on every container and volume a sandbox makes (value: the sandbox id)."""
OWNER_LABEL = "lachesis.owner"
HOST_LABEL = "lachesis.host"

WORKSPACE = "/workspace"
"""Where the workspace is, seen from inside every sandbox."""
SANDBOX_UID = 1000
"""The uid (and gid) commands run as, seen from inside the sandbox."""
DEFAULT_IMAGE = "lachesis-sandbox-python"
"""Docker image (repository) that ``environments.sandbox.images`` builds; the tag is the
recipe's hash, see :func:`environments.sandbox.images.default_image`."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (start, exec machinery, daemon). Not the agent's doing."""


class MissingSystemPackage(SandboxError):
    """A program the sandbox needs is not on this machine: ``package`` is the Debian
    package that brings it (``make system-deps`` installs them all)."""

    def __init__(self, program: str, package: str, detail: str = "") -> None:
        self.program, self.package = program, package
        super().__init__(f"{program} is not installed (Debian/Ubuntu: apt-get install "
                         f"{package}; `make system-deps` installs what the tests need)"
                         + (f": {detail}" if detail else ""))


class SandboxUsageError(ValueError):
    """A request the sandbox refuses (bad path, over a limit). Fit to show the model."""


class SandboxPathError(SandboxUsageError):
    """A path that leaves the workspace."""


class SandboxConfig(BaseModel):
    """How sandboxes are made, and their limits."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    backend: Literal["bwrap", "docker", "unsafe_subprocess"] = "bwrap"
    """``bwrap`` (bubblewrap, unprivileged; the default), ``docker`` (one container per
    sandbox) or ``unsafe_subprocess`` (no isolation at all; needs ``allow_unsafe``)."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit of one ``exec`` (unless the call passes its own); the command's
    processes are killed when it is reached."""
    cpu_time_s: int = Field(default=10, ge=1)
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = Field(default=512, ge=16)
    """bwrap / unsafe: address space per process (RLIMIT_AS). docker: the container's
    memory (cgroup), swap included."""
    max_processes: int = Field(default=64, ge=4)
    """Processes (and threads) at once. bwrap as root: each sandbox runs under its own
    host uid, so this counts the sandbox alone; as a normal user it is added to what the
    user already runs (RLIMIT_NPROC counts per user). docker: the pids cgroup."""
    max_output_bytes: int = Field(default=64 * 1024, ge=1024)
    """stdout and stderr of one exec are each kept up to this size; a command that
    writes more is killed and its result flagged ``output_truncated``."""
    max_file_mb: int = Field(default=64, ge=1)
    """Largest file a command may write (RLIMIT_FSIZE), and largest file ``read_file`` /
    ``write_file`` move."""
    workspace_mb: int = Field(default=256, ge=1)
    """docker: the size of the workspace (a tmpfs volume; writes past it fail with
    ENOSPC). bwrap / unsafe: checked after every exec; the result is flagged
    ``workspace_over_quota`` and ``write_file`` refuses until files are removed."""
    network: bool = False
    """Give the sandbox network access (off: no interface but loopback)."""
    allow_unsafe: bool = False
    """Required for ``backend: unsafe_subprocess`` (commands run as this process's user
    with its filesystem: only for trusted code)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of every command (on top of PATH, HOME, LANG)."""
    workspace_root: Path | None = None
    """bwrap / unsafe: where workspaces are made (default ``$TMPDIR/lachesis-sandboxes``)."""
    ro_binds: list[str] = Field(default_factory=lambda: ["/usr", "/bin", "/sbin", "/lib",
                                                         "/lib32", "/lib64", "/libx32"])
    """bwrap: host paths visible read-only (symlinks such as /bin -> usr/bin are recreated
    as symlinks; missing paths are skipped). Nothing else of the host is visible: /etc is
    a made-up one (passwd, group, hosts), /tmp a private tmpfs, /proc the sandbox's own."""
    ro_mounts: dict[str, str] = Field(default_factory=dict)
    """Host directories mounted read-only into the sandbox: ``{host path: sandbox path}``
    (bwrap and docker; e.g. an agent's runtime, the interception proxy's socket
    directory). unsafe_subprocess cannot remap paths and refuses them."""
    image: str | None = None
    """docker: the image (default: the one ``python -m environments.sandbox build-image``
    makes)."""
    docker_cpus: float = Field(default=1.0, gt=0)
    """docker: CPUs the container may use."""
    docker_network: str = "bridge"
    """docker: the network used when ``network`` is on."""


@dataclass
class ExecResult:
    """What one command did."""

    exit_code: int | None
    """The exit status; None when the command was killed (timeout, output limit)."""
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    output_truncated: bool = False
    """stdout or stderr went past ``max_output_bytes``: kept up to it, command killed."""
    workspace_over_quota: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated

    @property
    def how_it_ended(self) -> str:
        """``exited with 1``, or, for a status that says a signal ended the command,
        ``killed by signal 9 (SIGKILL)``: a negative status (Python's), 128 + N (a shell's,
        bwrap's, docker's) or 256 - N (a negative status seen as a byte)."""
        code = self.exit_code
        if code is None:
            return "was killed"
        signal_number = -code if code < 0 else code - 128 if 128 < code <= 128 + 64 \
            else 256 - code if 256 - 64 <= code < 256 else None
        if signal_number is None:
            return f"exited with {code}"
        try:
            name = f" ({signal.Signals(signal_number).name})"
        except ValueError:
            name = ""
        raw = "" if code < 0 else f", exit status {code}"
        return f"was killed by signal {signal_number}{name}{raw}"

    def describe(self, max_chars: int = 4000) -> str:
        """A compact text for a model: output, then what went wrong, if anything."""
        parts = []
        if self.stdout:
            parts.append(self.stdout)
        if self.stderr:
            parts.append(self.stderr if not self.stdout else "[stderr]\n" + self.stderr)
        text = "\n".join(p.rstrip("\n") for p in parts)
        if len(text) > max_chars:
            text = text[:max_chars] + f"\n... ({len(text) - max_chars} more characters)"
        notes = []
        if self.timed_out:
            notes.append(f"timed out after {self.duration_s:.1f} s and was killed")
        if self.output_truncated:
            notes.append("output limit reached; the command was killed")
        if self.workspace_over_quota:
            notes.append("the workspace is over its disk quota")
        if self.exit_code not in (0, None):
            notes.append(f"exit code {self.exit_code}")
        if notes:
            text = (text + "\n" if text else "") + "[" + "; ".join(notes) + "]"
        return text or "(no output)"


def workspace_relative(path: str) -> str:
    """``path`` (relative to the workspace, or absolute under it) as a normalized relative
    POSIX path; SandboxPathError when it leaves the workspace or names it itself."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SandboxPathError(f"bad path {path!r}")
    if path.startswith("/"):
        if path != WORKSPACE and not path.startswith(WORKSPACE + "/"):
            raise SandboxPathError(f"{path!r} is outside the workspace ({WORKSPACE})")
        path = path[len(WORKSPACE):].lstrip("/")
    normalized = posixpath.normpath(path) if path else "."
    if normalized == ".." or normalized.startswith("../"):
        raise SandboxPathError(f"{path!r} is outside the workspace ({WORKSPACE})")
    if normalized == ".":
        raise SandboxPathError(f"{path!r} is the workspace itself, not a file in it")
    return normalized


def to_bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def default_workspace_root() -> Path:
    return Path(tempfile.gettempdir()) / "lachesis-sandboxes"


def process_start_time(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot) or None if it does not exist;
    ``(pid, start time)`` names a process even after its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(b")", 1)[1].split()[19].decode()


def owner_tag() -> str:
    """``PID.STARTTIME`` of this process, recorded on everything it creates."""
    return f"{os.getpid()}.{process_start_time(os.getpid()) or 0}"


def owner_alive(tag: str) -> bool:
    pid, _, start = tag.partition(".")
    try:
        return process_start_time(int(pid)) == start
    except ValueError:
        return False


class OutputCollector:
    """Keeps up to ``limit`` bytes of a stream; notes when more arrived."""

    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()
        self.overflow = False

    def add(self, chunk: bytes) -> bool:
        """Add ``chunk``; True the first time the limit is passed."""
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if len(chunk) > room and not self.overflow:
            self.overflow = True
            return True
        return False

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


_LIVE: weakref.WeakSet[Sandbox] = weakref.WeakSet()
"""Sandboxes of this process not closed yet."""
_REAPED: set[str] = set()
"""Backends whose leftovers this process has reaped (once, at the first sandbox)."""


class Sandbox(abc.ABC):
    """One isolated workspace. Make one with :func:`create_sandbox` (or
    ``await Backend.create(config)``); close it with ``close()`` or ``async with``.

    Calls on one sandbox run one at a time (an exec and a file write never overlap), so
    the host-side file operations never race a command of the sandbox.

    Cleanup is guaranteed three ways: ``close()`` (``async with``); a finalizer that runs
    when a sandbox that was never closed is garbage-collected, and at interpreter exit;
    and :func:`environments.sandbox.reap`, which removes what processes that died (a
    crashed rollout worker, ``kill -9``) left behind. Every backend calls it once per
    process, at its first sandbox.
    """

    backend: ClassVar[str] = ""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.id = uuid.uuid4().hex[:12]
        self.created_at = time.time()
        self.closed = False
        self._lock = asyncio.Lock()
        self._finalizer: weakref.finalize | None = None

    @classmethod
    async def create(cls, config: SandboxConfig | None = None) -> Sandbox:
        config = config or SandboxConfig(backend=cls.backend)
        box = cls(config)
        if cls.backend not in _REAPED:
            _REAPED.add(cls.backend)
            try:
                await asyncio.to_thread(cls.reap_leftovers, config)
            except Exception as error:  # noqa: BLE001 - reaping is best effort
                log.warning("reaping leftover %s sandboxes failed: %s", cls.backend, error)
        try:
            await box._start()
        except BaseException:
            await asyncio.shield(box._cleanup_after_failed_start())
            raise
        _LIVE.add(box)
        return box

    @classmethod
    def reap_leftovers(cls, config: SandboxConfig) -> None:
        """Remove what sandboxes of this backend whose owner died left behind
        (:mod:`environments.sandbox.reaper`); run once per process, at its first sandbox."""

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"{self.backend} sandbox {self.id} is closed")

    # -- the API -------------------------------------------------------------------------
    async def exec(self, command: str | list[str], *, timeout_s: float | None = None,
                   env: dict[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        """Run ``command`` (a string: through ``/bin/sh -c``; a list: as is) in the
        workspace (or ``cwd`` inside it), within ``timeout_s`` (default
        ``config.timeout_s``)."""
        self._check_open()
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise SandboxUsageError("empty command")
        workdir = WORKSPACE if cwd is None else f"{WORKSPACE}/{workspace_relative(cwd)}"
        async with self._lock:
            self._check_open()
            return await self._exec(argv, timeout, {**self.config.env, **(env or {})}, workdir)

    async def write_file(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` in the workspace (parents are created)."""
        self._check_open()
        relative = workspace_relative(path)
        data = to_bytes(data)
        if len(data) > self.config.max_file_mb << 20:
            raise SandboxUsageError(f"{path}: {len(data)} bytes is over the "
                                    f"{self.config.max_file_mb} MB file limit")
        async with self._lock:
            self._check_open()
            await self._write(relative, data, mode)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The content of ``path`` in the workspace (FileNotFoundError if missing);
        SandboxUsageError when it is larger than ``max_bytes`` (default: the file limit)."""
        self._check_open()
        relative = workspace_relative(path)
        limit = self.config.max_file_mb << 20 if max_bytes is None else max_bytes
        async with self._lock:
            self._check_open()
            return await self._read(relative, limit)

    async def upload(self, local: str | Path, path: str) -> None:
        """Copy the host file or directory ``local`` to ``path`` in the workspace."""
        local = Path(local)
        if local.is_dir():
            for file in sorted(p for p in local.rglob("*") if p.is_file()):
                target = posixpath.join(workspace_relative(path),
                                        file.relative_to(local).as_posix())
                await self.write_file(target, file.read_bytes(),
                                      mode=file.stat().st_mode & 0o755 | 0o644)
        elif local.is_file():
            await self.write_file(path, local.read_bytes(),
                                  mode=local.stat().st_mode & 0o755 | 0o644)
        else:
            raise FileNotFoundError(f"no such file or directory: {local}")

    async def download(self, path: str, local: str | Path) -> None:
        """Copy the file ``path`` of the workspace to the host file ``local``."""
        data = await self.read_file(path)
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)

    async def close(self) -> None:
        """Kill whatever runs in the sandbox and remove it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        try:
            await asyncio.shield(self._close())
        finally:
            if self._finalizer is not None:
                self._finalizer.detach()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<{type(self).__name__} {self.id} {state}>"

    # -- what a backend implements --------------------------------------------------------
    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    async def _exec(self, argv: list[str], timeout_s: float, env: dict[str, str],
                    workdir: str) -> ExecResult: ...

    @abc.abstractmethod
    async def _write(self, relative: str, data: bytes, mode: int) -> None: ...

    @abc.abstractmethod
    async def _read(self, relative: str, limit: int) -> bytes: ...

    @abc.abstractmethod
    async def _close(self) -> None: ...

    async def _cleanup_after_failed_start(self) -> None:
        try:
            await self._close()
        except Exception as error:  # noqa: BLE001
            log.warning("cleaning up after a failed start of %s: %s", self, error)

    def _base_env(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": WORKSPACE,
                "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def live_sandboxes() -> list[Sandbox]:
    """The sandboxes of this process that are not closed yet."""
    return list(_LIVE)


async def close_all() -> int:
    """Close every sandbox of this process that is still open; returns how many."""
    boxes = live_sandboxes()
    await asyncio.gather(*(b.close() for b in boxes), return_exceptions=True)
    return len(boxes)
