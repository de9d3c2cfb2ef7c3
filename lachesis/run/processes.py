"""Child processes of a run: started in their own process group with a log file, stopped
with their whole group, and never left behind.

Three layers make sure no process of a run outlives it:

* every child is a process-group leader (``start_new_session``): stopping it signals the
  group, so e.g. vLLM's engine core or torchrun's workers go with it;
* every command runs under a guard (:mod:`lachesis.run.guard`) that leads the group
  and has a parent-death signal: if the supervisor itself is killed, the guard kills its
  whole group, grandchildren included;
* every process of the run inherits ``LACHESIS_RUN_ID``; at the end the supervisor (a
  child subreaper, so orphans are re-parented to it) kills whatever still carries it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RUN_ID_VARIABLE = "LACHESIS_RUN_ID"
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def tree_cpu_seconds(root_pid: int, *, include_root: bool = True,
                     reaped: bool = False) -> float:
    """CPU seconds (user + system) of ``root_pid``'s descendants, and of ``root_pid``
    itself unless ``include_root`` is false, read from /proc (0.0 where there is none).
    ``reaped`` adds what each of them has reaped of its own children (a process's
    ``cutime``/``cstime``), so CPU does not vanish from the sum when a child ends."""
    last = 15 if reaped else 13  # utime, stime (, cutime, cstime): /proc/PID/stat 14-17
    try:
        tick = os.sysconf("SC_CLK_TCK")
        children: dict[int, list[int]] = {}
        cpu: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            cpu[int(entry)] = sum(int(f) for f in fields[11:last]) / tick
    except (OSError, ValueError):
        return 0.0
    total = cpu.get(root_pid, 0.0) if include_root else 0.0
    stack = list(children.get(root_pid, []))
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack += children.get(pid, [])
    return total


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed on this machine
    since it booted (``oom_kill`` in /proc/vmstat, Linux 4.13+); None where it does not say.
    Machine-wide: a container's processes count, and so do its neighbours'."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def oom_kills_since(before: int | None) -> int:
    """Processes the out-of-memory killer has killed on this machine since :func:`oom_kills`
    was ``before`` (0 where either is unknown)."""
    now = oom_kills()
    return 0 if before is None or now is None else max(0, now - before)


def ended_text(name: str, code: int, oom_killed: int = 0) -> str:
    """How a process of the run ended, for a person: its exit code, or the signal that
    killed it; and, when it failed, ``oom_killed``: how many processes the kernel's
    out-of-memory killer killed on this machine while it ran (:func:`oom_kills_since`),
    which is how a process that ran out of memory dies (SIGKILL, or code 1 from torchrun
    or vLLM when a worker of theirs was the one killed)."""
    try:
        text = (f"{name} was killed by {signal.Signals(-code).name}" if code < 0
                else f"{name} exited with code {code}")
    except ValueError:
        text = f"{name} exited with code {code}"
    if code != 0 and oom_killed:
        text += (f" (the kernel's out-of-memory killer killed {oom_killed} "
                 f"process{'es' * (oom_killed > 1)} on this machine while it ran; "
                 "`dmesg | grep -i 'killed process'` names them)")
    return text


GUARD_PARENT_VARIABLE = "LACHESIS_GUARD_PARENT"
"""The pid of the process that started a guard: the guard dies at once when its parent is
no longer that one (its starter died before the guard had armed its parent-death signal;
``getppid()`` read by the guard itself would already name the reaper then)."""


def prctl_parent_death_signal(sig: int) -> None:
    """The kernel sends ``sig`` to this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, sig)


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


@dataclass
class ChildProcess:
    """One process of the run (``name`` is e.g. ``api``, ``vllm``, ``env-arithmetic_tool``)."""

    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    stdout_path: Path | None = None
    """Where stdout goes when it is wanted apart from the log (e.g. a JSON result)."""
    proc: subprocess.Popen | None = None
    log_start: int = 0
    """Where this start's part of the log begins (a restarted process appends to it)."""
    oom_kills_at_start: int | None = None
    """:func:`oom_kills` when this start began."""

    def start(self) -> ChildProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log, \
                (open(self.stdout_path, "wb") if self.stdout_path else contextlib.nullcontext(log)) as out:
            self.log_start = log.tell()
            self.oom_kills_at_start = oom_kills()
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lachesis.run.guard", *self.command],
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env,
                     GUARD_PARENT_VARIABLE: str(os.getpid())},
                stdin=subprocess.DEVNULL, stdout=out, stderr=log, start_new_session=True)
        return self

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n_lines: int = 30) -> str:
        """The last lines this start of the process wrote (not an earlier start's)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n_lines:])

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group; SIGKILL it after ``grace_s``. Returns the exit code."""
        # imported here: the guard (python -m lachesis.run.guard, one per process of a run)
        # imports this module, and ``environments`` takes it most of a second to import
        from environments.inference.vllm_process import stop_process_group

        return None if self.proc is None else stop_process_group(self.proc, grace_s)

    def kill(self) -> int | None:
        """SIGKILL the whole process group now (a hung or SIGSTOPped process acts on no
        other signal); returns the exit code."""
        from environments.inference.vllm_process import signal_process_group

        if self.proc is None:
            return None
        signal_process_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return self.proc.returncode


def processes_of_run(run_id: str, variable: str = RUN_ID_VARIABLE) -> list[int]:
    """PIDs of live processes whose environment carries ``LACHESIS_RUN_ID=run_id`` (or
    ``variable=run_id``)."""
    marker = f"{variable}={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_leftovers(run_id: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every remaining process of the run and reap the ones re-parented to us.
    Returns the PIDs that had to be killed."""
    killed = processes_of_run(run_id)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while processes_of_run(run_id) and time.monotonic() < deadline:
        reap_children()
        time.sleep(0.1)
    reap_children()
    return killed


def reap_children() -> None:
    """Collect exited children that no Popen waits for (orphans adopted as subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
