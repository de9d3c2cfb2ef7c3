"""The ``docker`` backend: one container per sandbox, through the ``docker`` Python SDK.

The container runs the image (per task: ``config.image``) with no network (``--network
none``) unless ``network``, a read-only root filesystem, every capability dropped,
``no-new-privileges``, uid 1000, a memory cgroup limit (swap included), a pids limit, a CPU
quota and rlimits (CPU seconds, file size, no core dumps). ``/workspace`` is a tmpfs volume
of ``workspace_mb`` (owned by uid 1000; files move in and out with the archive API) and
``/tmp`` a small tmpfs. PID 1 is a shell loop that reaps orphans, so the container lives
until ``close()``, which removes it and its volume.

Each exec runs under ``timeout -s KILL`` (coreutils, in the image) in its own process
group, killed when the command ends (so ``cmd &`` ends with the exec, as with bwrap; only
a process that leaves the group, e.g. with ``setsid``, lives on until ``close()``), and
from a second exec when its output goes past the limit. The SDK is synchronous: every
call runs in a worker thread, never on the event loop. Note: uid 1000 in the container is
uid 1000 on the host unless the daemon uses ``userns-remap``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import secrets
import socket
import tarfile
import threading
import time
import weakref
from typing import Any

from environments.sandbox.base import (
    HOST_LABEL,
    LABEL,
    OWNER_LABEL,
    SANDBOX_UID,
    WORKSPACE,
    ExecResult,
    OutputCollector,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxPathError,
    SandboxUsageError,
    owner_tag,
)
from environments.sandbox.images import default_image, docker_client
from environments.sandbox.reaper import reap_docker

log = logging.getLogger(__name__)

PID1 = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1 & wait $!; done"]
"""The container's main process: sleeps, and reaps orphans (``wait`` reaps any child)."""
_PIDFILE = "/tmp/.lachesis-exec.pid"
_OUTPUT = "/tmp/.lachesis-exec"
"""Prefix of the files (in the container's /tmp) that keep the running exec's output."""
_WRAPPER = (
    f'f={_OUTPUT}; m="$1"; shift; printf %s "$m"; printf %s "$m" >&2; '
    f'rm -f $f.o $f.e; mkfifo $f.o $f.e || exit 125; '
    f'tee $f.out < $f.o 2>/dev/null & a=$!; tee $f.err < $f.e >&2 2>/dev/null & b=$!; '
    f'timeout -s KILL "$0" "$@" > $f.o 2> $f.e & pid=$!; echo $pid > {_PIDFILE}; '
    'wait $pid; rc=$?; kill -KILL -- -$pid 2>/dev/null; wait $a; wait $b; '
    'printf %s "$m"; printf %s "$m" >&2; exit $rc')
"""Runs the command under a hard wall-clock limit in its own process group (``timeout``
makes itself group leader), records that group in the pid file (to kill it on too much
output), and kills what is left of the group when the command ends: background jobs and
fork-bomb leftovers do not outlive the exec, as with bwrap. A process that leaves the
group (``setsid``) lives until ``close()``.

The command's stdout and stderr also go to files (``tee``), and each stream begins with the
exec's mark and ends with it once all of it is written. Under load the daemon can lose
either end of an exec's stream: close it before it has passed on the last of the output
(a fast command's output can come back empty with its exit code: moby/moby#27289,
docker/docker-py#2042), or attach to it after the first output was written (seen in
`make test`: of `ls | sort; cat`, only cat's output came back, exit code 0). A stream that
lacks either mark is read again from the files (:meth:`DockerSandbox._saved_output`)."""


def _between_marks(data: bytes, mark: bytes) -> bytes | None:
    """What a stream brought between its two marks, or None when it lost either end."""
    if len(data) >= 2 * len(mark) and data.startswith(mark) and data.endswith(mark):
        return data[len(mark):-len(mark)]
    return None


def _new_mark() -> bytes:
    """An exec's mark for both ends of its streams: unlikely in any output, new for every
    exec."""
    return f"\x1e{secrets.token_hex(8)}\x1e".encode()


_GO_MODE_TYPE = sum(1 << bit for bit in (31, 27, 26, 25, 24, 21, 19))
"""Go's os.ModeType (directory, symlink, named pipe, socket, device...): the archive API's
``mode`` of anything that is not a regular file has one of these bits."""

def _cleanup(resources: dict) -> None:
    """Finalizer of a sandbox that was never closed (GC or interpreter exit)."""
    client = resources.get("client")
    for kind in ("container", "volume"):
        name = resources.get(kind)
        if client is None or name is None:
            continue
        try:
            if kind == "container":
                client.api.remove_container(name, force=True)
            else:
                client.api.remove_volume(name, force=True)
        except Exception:  # noqa: BLE001 - gone already; the reaper gets the rest
            pass


class DockerSandbox(Sandbox):
    backend = "docker"

    @classmethod
    def reap_leftovers(cls, config: SandboxConfig) -> None:
        reap_docker()

    async def _start(self) -> None:
        self._resources: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, _cleanup, self._resources)
        self.client = await asyncio.to_thread(docker_client)
        self._resources["client"] = self.client
        self.image = self.config.image or default_image()
        await asyncio.to_thread(self._start_sync)

    def _labels(self) -> dict[str, str]:
        return {LABEL: self.id, OWNER_LABEL: owner_tag(), HOST_LABEL: socket.gethostname(),
                "lachesis.created": f"{self.created_at:.0f}"}

    def _start_sync(self) -> None:
        import docker
        from docker.types import Ulimit

        c = self.config
        name = f"lachesis-sandbox-{self.id}"
        try:
            volume = self.client.volumes.create(
                name=name, driver="local", labels=self._labels(),
                driver_opts={"type": "tmpfs", "device": "tmpfs",
                             "o": f"size={c.workspace_mb}m,uid={SANDBOX_UID},"
                                  f"gid={SANDBOX_UID},mode=0700"})
            self._resources["volume"] = volume.name
            container = self.client.containers.run(
                self.image, PID1, name=name, detach=True, labels=self._labels(),
                user=f"{SANDBOX_UID}:{SANDBOX_UID}", working_dir=WORKSPACE,
                network_mode=c.docker_network if c.network else "none",
                read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"],
                volumes={volume.name: {"bind": WORKSPACE, "mode": "rw"},
                         **{host: {"bind": inside, "mode": "ro"}
                            for host, inside in c.ro_mounts.items()}},
                tmpfs={"/tmp": "size=64m,mode=1777,exec"},
                mem_limit=f"{c.memory_mb}m", memswap_limit=f"{c.memory_mb}m",
                pids_limit=c.max_processes, nano_cpus=int(c.docker_cpus * 1e9),
                ulimits=[Ulimit(name="cpu", soft=c.cpu_time_s, hard=c.cpu_time_s),
                         Ulimit(name="fsize", soft=c.max_file_mb << 20,
                                hard=c.max_file_mb << 20),
                         Ulimit(name="core", soft=0, hard=0)],
                environment={**self._base_env(), **c.env}, hostname="sandbox")
            self._resources["container"] = container.id
            self.container = container
        except docker.errors.ImageNotFound as error:
            raise SandboxError(f"docker image {self.image!r} not found; build it with "
                               "`python -m environments.sandbox build-image`") from error
        except docker.errors.DockerException as error:
            raise SandboxError(f"could not start a container: {error}") from error

    # -- exec ------------------------------------------------------------------------------
    async def _exec(self, argv: list[str], timeout_s: float, env: dict[str, str],
                    workdir: str) -> ExecResult:
        started = time.monotonic()
        done = threading.Event()
        job = asyncio.ensure_future(asyncio.to_thread(self._exec_sync, argv, timeout_s, env,
                                                      workdir, done))
        try:
            # ``timeout`` inside kills the command; this is for a stream held open by a
            # process that left the group (``setsid cmd &``), or a daemon that hangs.
            await asyncio.wait_for(asyncio.shield(job), timeout_s + 15)
        except TimeoutError:
            await asyncio.to_thread(self._kill_all)
            try:
                await asyncio.wait_for(asyncio.shield(job), 15)
            except TimeoutError:
                raise SandboxError(f"exec in container {self.id} did not finish") from None
        except asyncio.CancelledError:
            done.set()
            await asyncio.shield(asyncio.to_thread(self._kill_all))
            raise
        exit_code, out, err, timed_out = job.result()
        truncated = out.overflow or err.overflow
        killed = timed_out or truncated
        return ExecResult(exit_code=None if killed else exit_code, stdout=out.text(),
                          stderr=err.text(), duration_s=time.monotonic() - started,
                          timed_out=timed_out, output_truncated=truncated)

    def _exec_sync(self, argv: list[str], timeout_s: float, env: dict[str, str],
                   workdir: str, cancelled: threading.Event):
        import docker

        api = self.client.api
        limit = self.config.max_output_bytes
        mark = _new_mark()
        out, err = OutputCollector(limit + 2 * len(mark)), OutputCollector(limit + 2 * len(mark))
        command = ["/bin/sh", "-c", _WRAPPER, f"{timeout_s:.3f}", mark.decode(), *argv]
        started = time.monotonic()
        try:
            exec_id = api.exec_create(self.container.id, command, workdir=workdir,
                                      environment=env or None,
                                      user=f"{SANDBOX_UID}:{SANDBOX_UID}")["Id"]
            killed = False
            for chunk_out, chunk_err in api.exec_start(exec_id, stream=True, demux=True):
                over = (out.add(chunk_out) if chunk_out else False) | \
                       (err.add(chunk_err) if chunk_err else False)
                if (over or cancelled.is_set()) and not killed:
                    # Kill from another thread and keep draining: a stream left unread
                    # stalls the daemon's other execs on this container, the kill too.
                    killed = True
                    threading.Thread(target=self._kill_group, daemon=True).start()
            exit_code = api.exec_inspect(exec_id).get("ExitCode")
            raw = [bytes(out.data), bytes(err.data)]
            whole = [_between_marks(data, mark) for data in raw]
            streams = [kept if kept is not None else data.removeprefix(mark).removesuffix(mark)
                       for kept, data in zip(whole, raw)]
            if not killed and None in whole:
                streams = self._saved_output(streams)  # the daemon lost an end of a stream
        except docker.errors.NotFound as error:
            raise SandboxError(f"container {self.id} is gone: {error}") from error
        except docker.errors.APIError as error:
            if error.status_code == 409:  # not running: it died (e.g. pid 1 killed)
                raise SandboxError(f"container {self.id} is not running: {error}") from error
            raise SandboxError(f"exec failed: {error}") from error
        except docker.errors.DockerException as error:
            raise SandboxError(f"exec failed: {error}") from error
        kept = []
        for data, streamed in zip(streams, (out, err)):
            collector = OutputCollector(limit)
            collector.add(data)
            collector.overflow |= streamed.overflow
            kept.append(collector)
        # timeout(1) exits 137 (128 + KILL) when it killed the command at the limit.
        timed_out = exit_code == 137 and time.monotonic() - started >= timeout_s * 0.98
        return exit_code, kept[0], kept[1], timed_out

    def _saved_output(self, streams: list[bytes], tries: int = 5) -> list[bytes]:
        """The exec's stdout and stderr as its files kept them, read by execs of ``cat``
        (idempotent, so one that loses its stream too is run again); for each, the
        longer of the file and what the stream brought (a file is short only when /tmp
        filled up)."""
        mark = _new_mark()
        script = (f'printf %s "$0"; printf %s "$0" >&2; cat {_OUTPUT}.out; printf %s "$0"; '
                  f'cat {_OUTPUT}.err >&2; printf %s "$0" >&2')
        for _ in range(tries):
            exec_id = self.client.api.exec_create(
                self.container.id, ["/bin/sh", "-c", script, mark.decode()],
                user=f"{SANDBOX_UID}:{SANDBOX_UID}")["Id"]
            saved = [b"", b""]
            for chunk_out, chunk_err in self.client.api.exec_start(exec_id, stream=True,
                                                                   demux=True):
                saved[0] += chunk_out or b""
                saved[1] += chunk_err or b""
            files = [_between_marks(data, mark) for data in saved]
            if None not in files:
                return [max(stream, data, key=len) for stream, data in zip(streams, files)]
        log.warning("sandbox %s: an exec's output came back incomplete %d times", self.id,
                    tries + 1)
        return streams

    def _kill_group(self) -> None:
        """Kill the running exec's process group (its pid is in the pid file); if the
        command removed the file, kill every process of the sandbox user."""
        script = (f'p=$(cat {_PIDFILE} 2>/dev/null) && kill -KILL -- "-$p" 2>/dev/null '
                  '|| kill -KILL -1')
        try:
            self.client.api.exec_start(self.client.api.exec_create(
                self.container.id, ["/bin/sh", "-c", script],
                user=f"{SANDBOX_UID}:{SANDBOX_UID}")["Id"])
        except Exception:  # noqa: BLE001 - the container may be gone
            pass

    def _kill_all(self) -> None:
        """Kill every process of the sandbox user but PID 1 (``kill -1`` spares it)."""
        try:
            self.client.api.exec_start(self.client.api.exec_create(
                self.container.id, ["/bin/sh", "-c", "kill -KILL -1"],
                user=f"{SANDBOX_UID}:{SANDBOX_UID}")["Id"])
        except Exception:  # noqa: BLE001
            pass

    # -- files (the archive API; paths are resolved by the daemon inside the container) ---
    def _write_sync(self, relative: str, data: bytes, mode: int) -> None:
        import docker

        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            now = time.time()
            # Missing parent directories are created as entries of the archive.
            parts = relative.split("/")[:-1]
            for i in range(len(parts)):
                info = tarfile.TarInfo("/".join(parts[:i + 1]))
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
                info.uid = info.gid = SANDBOX_UID
                archive.addfile(info)
            info = tarfile.TarInfo(relative)
            info.size, info.mode, info.mtime = len(data), mode, now
            info.uid = info.gid = SANDBOX_UID
            archive.addfile(info, io.BytesIO(data))
        try:
            ok = self.client.api.put_archive(self.container.id, WORKSPACE, buffer.getvalue())
        except docker.errors.APIError as error:
            if error.status_code in (400, 403, 404, 500) and "space" in str(error).lower():
                raise SandboxUsageError(f"{relative}: no space left in the workspace") from error
            if error.status_code in (400, 403, 404):
                raise SandboxPathError(f"{relative}: cannot write there ({error.explanation})"
                                       ) from error
            raise SandboxError(f"writing {relative} failed: {error}") from error
        if not ok:
            raise SandboxError(f"writing {relative} failed")

    def _read_sync(self, relative: str, limit: int) -> bytes:
        import docker

        try:
            stream, info = self.client.api.get_archive(self.container.id,
                                                       f"{WORKSPACE}/{relative}")
        except docker.errors.NotFound:
            raise FileNotFoundError(f"no such file in the workspace: {relative}") from None
        except docker.errors.APIError as error:
            raise SandboxError(f"reading {relative} failed: {error}") from error
        if info.get("linkTarget"):
            raise SandboxPathError(f"{relative} is a symlink")
        if info.get("mode", 0) & _GO_MODE_TYPE:
            raise SandboxPathError(f"{relative} is not a regular file")
        if info.get("size", 0) > limit:
            raise SandboxUsageError(f"{relative} is {info['size']} bytes, over the {limit}-byte "
                                    "read limit")
        data = b"".join(stream)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            member = archive.next()
            if member is None or not member.isfile():
                raise SandboxPathError(f"{relative} is not a regular file")
            return archive.extractfile(member).read()[:limit]

    async def _write(self, relative: str, data: bytes, mode: int) -> None:
        await asyncio.to_thread(self._write_sync, relative, data, mode)

    async def _read(self, relative: str, limit: int) -> bytes:
        return await asyncio.to_thread(self._read_sync, relative, limit)

    async def _close(self) -> None:
        resources = getattr(self, "_resources", None)
        if resources:
            await asyncio.to_thread(_cleanup, resources)
            resources.pop("container", None)
            resources.pop("volume", None)

