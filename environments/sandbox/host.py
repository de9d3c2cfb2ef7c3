"""Host-side helpers of the sandboxes that run processes on this machine (bwrap and
unsafe_subprocess) and of the reaper: killing process groups, removing workspaces that
sandboxed code left unwritable, counting a uid's tasks, and collecting a process's output
within the limits."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

from environments.sandbox.base import ExecResult, OutputCollector, SandboxError


def kill_pids(pids: set[int]) -> None:
    for pid in list(pids):
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    pids.clear()


def remove_tree(path: Path) -> None:
    """``rm -rf path``, also when the sandbox left directories without write permission."""
    def fix_and_retry(function, name, _exc_info):
        try:
            os.chmod(os.path.dirname(name), 0o700)
            if os.path.isdir(name) and not os.path.islink(name):
                os.chmod(name, 0o700)
            function(name)
        except FileNotFoundError:
            pass

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onerror=fix_and_retry)


def cleanup_workspace(resources: dict) -> None:
    """Finalizer of a sandbox that was never closed (GC or interpreter exit)."""
    kill_pids(resources["pids"])
    try:
        remove_tree(resources["dir"])
    except OSError:
        pass


def user_task_count(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count


async def _wait_killed(proc: asyncio.subprocess.Process, pumps: asyncio.Future) -> None:
    """After a cancel (or an error): wait briefly for the killed process, so that its
    transport is closed while the event loop still runs (no "Event loop is closed" at
    exit), and mark the output pumps' outcome as seen."""
    pumps.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
    except BaseException:  # noqa: BLE001 - cleanup only; the caller re-raises its error
        pass


async def run_process(proc: asyncio.subprocess.Process, pids: set[int], timeout_s: float,
                      max_output: int, started: float) -> ExecResult:
    """Collect a started process's output within the limits; kill it (and its process
    group) on timeout, on too much output, or when the caller is cancelled."""
    pids.add(proc.pid)
    out, err = OutputCollector(max_output), OutputCollector(max_output)

    def kill() -> None:
        for killer in (os.killpg, os.kill):
            try:
                killer(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    async def pump(stream: asyncio.StreamReader, collector: OutputCollector) -> None:
        while chunk := await stream.read(1 << 16):
            if collector.add(chunk):
                kill()

    pumps = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.shield(pumps), timeout_s)
        except TimeoutError:
            timed_out = True
            kill()
        try:  # after a kill the pipes close as soon as the namespace is gone
            await asyncio.wait_for(pumps, 10)
        except TimeoutError:
            pumps.cancel()
        try:
            returncode = await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            raise SandboxError(f"process {proc.pid} did not exit 10 s after SIGKILL") from None
    except BaseException:
        kill()
        pumps.cancel()
        await _wait_killed(proc, pumps)
        raise
    finally:
        if proc.returncode is not None:
            pids.discard(proc.pid)
    killed = timed_out or out.overflow or err.overflow
    return ExecResult(exit_code=None if killed else returncode, stdout=out.text(),
                      stderr=err.text(), duration_s=time.monotonic() - started,
                      timed_out=timed_out, output_truncated=out.overflow or err.overflow)
