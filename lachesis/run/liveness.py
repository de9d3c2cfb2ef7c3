"""Liveness: the supervisor tells a process that is alive but answers nothing (frozen,
deadlocked, SIGSTOPped) from one that is busy, and names it.

Every ``liveness.check_every_s`` the supervisor looks at each process of the run it
watches:

* a process with a health endpoint (the rollout API, each vLLM replica's API server, an
  env's own server, the Atropos bridge) must answer ``GET`` on it within
  ``liveness.health_timeout_s``;
* a process that beats (:mod:`environments.heartbeat`: the trainer's ranks, the env
  servers, vLLM's API server and its engine core) must have written a beat; every
  process of it that beats counts (vLLM's engine core apart from its API server, each
  trainer rank).

A process whose last answer (or oldest last beat) is older than its kind's
``liveness.hang_timeout_s`` is hung; before its first answer after a (re)start, the
bound is its start-up timeout (``vllm.startup_timeout_s`` for a vLLM start,
``startup_timeout_s`` for the others; an env server beats from its start on, so its
``setup()`` has ``hang_timeout_s.env`` between beats instead, and
``liveness.setup_timeout_s`` for the whole start). The supervisor
then names it (kind, name, address, how long, what it was doing), kills its process
group with SIGKILL (a SIGSTOPped process acts on nothing else) and restarts it like one
that died. Heartbeat files are read on this machine only: on a Ray cluster the
supervisor checks the health endpoints, not beats.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from environments.heartbeat import DIR_VARIABLE, NAME_VARIABLE, PERIOD_VARIABLE

KINDS = ("api", "vllm", "env", "trainer", "server")
"""The kinds of process the run watches (``server``: an env's own server, the Atropos
bridge)."""


@dataclass
class Watched:
    """One process the supervisor checks."""

    name: str
    kind: str
    health_url: str | None
    """Answers ``GET`` while the process is alive (None: it has no endpoint)."""
    beats: bool
    """It writes heartbeats (and must, once started)."""
    startup_s: float
    """The bound before its first answer or beat after a start."""
    startup_setting: str = "startup_timeout_s"
    """The setting that gave ``startup_s`` (named when the bound is passed)."""
    where: str | None = None
    """Asked from this place of the placement (None: from here)."""
    started: float = field(default_factory=time.monotonic)
    answered: float | None = None
    """When its health endpoint last answered (monotonic)."""
    beaten: bool = False
    """It has beaten since it started."""


@dataclass
class Hang:
    """A process found hung: who, where, for how long, against which bound."""

    name: str
    kind: str
    address: str
    silent_s: float
    bound_s: float
    setting: str
    what: str
    """``has not answered GET URL`` / ``sent no heartbeat (pid N, engine; last doing X)``."""
    at: float = field(default_factory=time.time)

    def text(self) -> str:
        return (f"{self.name} ({self.kind}, {self.address}) {self.what} for "
                f"{self.silent_s:.0f} s, more than {self.setting} {self.bound_s:g} s")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a stopped one counts; a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def read_beats(directory: Path, name: str) -> list[dict[str, Any]]:
    """The beats of ``name``'s live processes (files of dead ones are removed)."""
    beats = []
    for path in directory.glob(f"{name}.*.json"):
        if not path.name[len(name) + 1:-len(".json")].isdigit():
            continue  # another process whose name starts with this one's and a dot
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced: read at the next check
        if not pid_alive(int(record.get("pid", 0))):
            path.unlink(missing_ok=True)
            continue
        beats.append(record)
    return beats


def overdue(beats: list[dict[str, Any]], flag: str, since: str,
            bound_s: float | None) -> tuple[dict[str, Any], float] | None:
    """The beat whose phase marked ``flag`` has gone on longest since its ``since`` time,
    and for how long, when that is more than ``bound_s`` (None: not bounded)."""
    marked = [b for b in beats if b.get(flag) and since in b]
    if bound_s is None or not marked:
        return None
    first = min(marked, key=lambda b: float(b[since]))
    took = time.time() - float(first[since])
    return (first, took) if took > bound_s else None


class Liveness:
    """The supervisor's liveness checks (see the module's docstring)."""

    def __init__(self, settings: Any, heartbeat_dir: Path | None,
                 answers: Callable[[str | None, str, float], bool]):
        self.settings = settings
        """The run's ``LivenessSettings``."""
        self.heartbeat_dir = heartbeat_dir
        """Where the processes beat (None: beats are not read, e.g. on a Ray cluster)."""
        self.answers = answers
        """``answers(where, url, timeout_s)``: whether ``url`` answers from ``where``."""
        self.watched: dict[str, Watched] = {}
        self.last_check = float("-inf")
        self.hangs: list[Hang] = []
        """Every hang found in this run, in order."""

    def environment(self, name: str) -> dict[str, str]:
        """The variables that make process ``name`` beat."""
        if self.heartbeat_dir is None:
            return {}
        return {DIR_VARIABLE: str(self.heartbeat_dir), NAME_VARIABLE: name,
                PERIOD_VARIABLE: f"{self.settings.heartbeat_period_s:g}"}

    def watch(self, name: str, kind: str, *, health_url: str | None = None,
              beats: bool = False, startup_s: float, where: str | None = None,
              startup_setting: str = "startup_timeout_s") -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r} of process {name}")
        self.watched[name] = Watched(name, kind, health_url,
                                     beats and self.heartbeat_dir is not None, startup_s,
                                     startup_setting, where)

    def started(self, name: str) -> None:
        """``name`` was (re)started: its clock starts over, its old beats are gone."""
        watched = self.watched.get(name)
        if watched is not None:
            watched.started, watched.answered, watched.beaten = time.monotonic(), None, False
        if self.heartbeat_dir is not None:
            for path in self.heartbeat_dir.glob(f"{name}.*.json"):
                path.unlink(missing_ok=True)

    def bound(self, kind: str) -> float | None:
        return getattr(self.settings.hang_timeout_s, kind)

    def due(self) -> bool:
        return time.monotonic() - self.last_check >= self.settings.check_every_s

    def check(self, running: Callable[[str], bool]) -> list[Hang]:
        """The watched processes (``running(name)``: not exited) that are hung now."""
        self.last_check = time.monotonic()
        found = []
        for watched in self.watched.values():
            if running(watched.name):
                hang = self.check_one(watched)
                if hang is not None:
                    found.append(hang)
        self.hangs += found
        return found

    def check_one(self, w: Watched) -> Hang | None:
        hang_s = self.bound(w.kind)
        setting = f"liveness.hang_timeout_s.{w.kind}"
        startup = w.startup_setting
        asked = time.monotonic()
        answered = w.health_url is not None and self.answers(
            w.where, w.health_url, self.settings.health_timeout_s)
        now = time.monotonic()  # after the health check: it may have waited its timeout
        if w.health_url is not None:
            if answered:
                w.answered = asked
            elif w.answered is None and now - w.started > w.startup_s:
                return Hang(w.name, w.kind, w.health_url, now - w.started, w.startup_s,
                            startup, f"has not answered GET {w.health_url} since it started")
            elif w.answered is not None and hang_s is not None and now - w.answered > hang_s:
                return Hang(w.name, w.kind, w.health_url, now - w.answered, hang_s, setting,
                            f"has not answered GET {w.health_url}")
        if not w.beats:
            return None
        beats = read_beats(self.heartbeat_dir, w.name)
        w.beaten = w.beaten or bool(beats)
        address = w.health_url or "this machine"
        if not beats:
            if not w.beaten and now - w.started > w.startup_s:
                return Hang(w.name, w.kind, address, now - w.started, w.startup_s, startup,
                            "has sent no heartbeat since it started")
            return None
        oldest = min(beats, key=lambda b: b.get("at", 0.0))
        silent = time.time() - float(oldest.get("at", 0.0))
        if hang_s is not None and silent > hang_s:
            doing = oldest.get("doing") or "-"
            since = time.time() - float(oldest.get("doing_since", time.time()))
            return Hang(w.name, w.kind, f"{address}, pid {oldest.get('pid')}", silent,
                        hang_s, setting, f"has sent no heartbeat (last: {oldest.get('role')} "
                        f"{doing}, for {since:.0f} s)")
        # beating, but a phase has gone on too long: a call that let go of Python's GIL and
        # never returns (a setup() on a socket or a lock; a collective, a device)
        longest = overdue(beats, "starting", "doing_since", self.settings.setup_timeout_s)
        if longest is not None:
            first, took = longest
            return Hang(w.name, w.kind, f"{address}, pid {first.get('pid')}", took,
                        self.settings.setup_timeout_s, "liveness.setup_timeout_s",
                        f"has not finished starting (doing: {first.get('doing') or '-'}; its "
                        "heartbeat still beats, so a call that let go of Python's GIL has not "
                        "returned: a socket or a lock that nothing answers)")
        # a phase that must show progress (environments/heartbeat.py) with no mark
        longest = overdue(beats, "must_progress", "progress_at", hang_s)
        if longest is not None:
            first, still = longest
            return Hang(w.name, w.kind, f"{address}, pid {first.get('pid')}", still,
                        hang_s, setting, f"has made no progress in {first.get('role')} "
                        f"{first.get('doing') or '-'} (its heartbeat still beats: a call "
                        "that let go of Python's GIL has not returned, such as a "
                        "collective waiting for another rank)")
        return None
