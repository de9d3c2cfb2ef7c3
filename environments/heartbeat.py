"""Heartbeats: how a process of a ``lachesis run`` shows the supervisor it is not frozen.

The supervisor sets ``LACHESIS_HEARTBEAT_DIR`` and ``LACHESIS_HEARTBEAT_NAME`` (the
process's name in the run: ``trainer``, ``env-arithmetic_tool``, ``vllm``) for every
process it starts; each process that beats writes ``DIR/NAME.PID.json`` about once a
``LACHESIS_HEARTBEAT_PERIOD_S`` (default 1 s):

    {"name": "trainer", "pid": 4242, "role": "trainer", "at": 1760000000.5,
     "doing": "step 7: forward, backward, optimizer", "doing_since": 1760000000.1,
     "must_progress": true, "progress_at": 1760000000.4, "starting": false}

``at`` is when it last beat (wall clock, read by the supervisor on the same machine);
``doing`` is what its main loop said it was doing last, for the supervisor's message when
the beats stop. A beat comes from a thread (:meth:`Heartbeat.start_thread`: the process
is scheduled and its interpreter runs; a SIGSTOPped process, or one stuck in a C call
that holds the GIL, stops beating) or from an asyncio task (:meth:`Heartbeat.beat_forever`:
the event loop itself turns; a loop blocked by a synchronous call stops beating). A
process forked from one that beats (vLLM's engine core) beats on its own with
:func:`beat_in_forked_children`. Without ``LACHESIS_HEARTBEAT_DIR`` nothing is written.

A thread beats on while the main thread waits in a call that let go of the GIL and never
returns: a collective waiting for a rank that never joins it, a device or a socket that
never answers. A phase that must end, or show progress, within the process's bound says
so (``doing(text, must_progress=True)``) and marks its progress (:func:`progressed`: a
micro-batch done); ``progress_at`` is the last mark, and the supervisor takes a phase
with no mark for longer than the bound for a hang even while the beats go on. Waits with
a bound of their own (a batch's ``max_batch_wait_s``) are not such phases. A process's
start (``doing(text, starting=True)``: an env server's ``setup()``) is bounded as a whole
from ``doing_since`` (``liveness.setup_timeout_s``), however it beats.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

DIR_VARIABLE = "LACHESIS_HEARTBEAT_DIR"
NAME_VARIABLE = "LACHESIS_HEARTBEAT_NAME"
PERIOD_VARIABLE = "LACHESIS_HEARTBEAT_PERIOD_S"


class Heartbeat:
    """Beats into ``directory/name.PID.json``."""

    def __init__(self, directory: Path, name: str, role: str, period_s: float = 1.0):
        self.directory = Path(directory)
        self.name = name
        self.role = role
        self.period_s = period_s
        self.pid = os.getpid()
        self.path = self.directory / f"{name}.{self.pid}.json"
        self.doing_text = "starting"
        self.doing_since = time.time()
        self.must_progress = False
        self.progress_at = self.doing_since
        self.starting = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def doing(self, text: str, *, must_progress: bool = False,
              starting: bool = False) -> None:
        """What the main loop does now (shown when the beats stop); ``must_progress``: it
        must end or mark progress (:meth:`progressed`) within the process's bound;
        ``starting``: the process's start, bounded as a whole by the supervisor."""
        now = time.time()
        if text != self.doing_text:
            self.doing_text, self.doing_since = text, now
        self.must_progress, self.progress_at, self.starting = must_progress, now, starting

    def progressed(self) -> None:
        """The phase under way moved on (a micro-batch done, a collective returned)."""
        self.progress_at = time.time()

    def beat(self) -> None:
        """Write the beat now (atomically: the supervisor may be reading it)."""
        record = {"name": self.name, "pid": self.pid, "role": self.role, "at": time.time(),
                  "doing": self.doing_text, "doing_since": self.doing_since,
                  "must_progress": self.must_progress, "progress_at": self.progress_at,
                  "starting": self.starting}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full disk must not kill the process; the supervisor sees no beat

    def start_thread(self) -> Heartbeat:
        """Beat from a daemon thread every ``period_s`` until :meth:`stop`."""
        self.beat()

        def run() -> None:
            while not self._stop.wait(self.period_s):
                self.beat()

        self._thread = threading.Thread(target=run, name="lachesis-heartbeat", daemon=True)
        self._thread.start()
        return self

    async def beat_forever(self) -> None:
        """Beat from the event loop every ``period_s`` (run it as a task)."""
        while not self._stop.is_set():
            self.beat()
            await asyncio.sleep(self.period_s)

    def stop(self, *, keep_file: bool = False) -> None:
        """Stop beating and remove the file (a process that ends is not a hung one);
        ``keep_file``: leave the last beat for another heartbeat of this process to go on
        from (no moment without a beat for the supervisor to read)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period_s + 1.0)  # no beat written after this
        if keep_file:
            return
        try:
            self.path.unlink()
        except OSError:
            pass


def from_environment(role: str) -> Heartbeat | None:
    """This process's heartbeat as the supervisor asked for it (None: not asked)."""
    directory = os.environ.get(DIR_VARIABLE)
    if not directory:
        return None
    name = os.environ.get(NAME_VARIABLE) or role
    try:
        period = float(os.environ.get(PERIOD_VARIABLE) or 1.0)
    except ValueError:
        period = 1.0
    return Heartbeat(Path(directory), name, role, max(0.05, period))


_THREAD_BEATS: dict[int, Heartbeat] = {}


def beat_in_thread(role: str) -> Heartbeat | None:
    """Start this process's thread heartbeat once (per process: vLLM loads its plugins
    more than once); None when the supervisor did not ask for one."""
    pid = os.getpid()
    if pid not in _THREAD_BEATS:
        heartbeat = from_environment(role)
        if heartbeat is None:
            return None
        _THREAD_BEATS[pid] = heartbeat.start_thread()
    return _THREAD_BEATS[pid]


def doing(text: str, *, must_progress: bool = False) -> None:
    """Tell this process's thread heartbeat what the main loop does now (nothing when it
    has none); ``must_progress``: see :meth:`Heartbeat.doing`."""
    heartbeat = _THREAD_BEATS.get(os.getpid())
    if heartbeat is not None:
        heartbeat.doing(text, must_progress=must_progress)


def progressed() -> None:
    """Mark progress of this process's phase under way (nothing when it has no thread
    heartbeat): one attribute set, cheap enough for every micro-batch."""
    heartbeat = _THREAD_BEATS.get(os.getpid())
    if heartbeat is not None:
        heartbeat.progressed()


def stop_thread_beat(*, keep_file: bool = False) -> None:
    """Stop this process's thread heartbeat (it ends: not a hung process; ``keep_file``:
    another heartbeat of the process takes over, see :meth:`Heartbeat.stop`)."""
    heartbeat = _THREAD_BEATS.pop(os.getpid(), None)
    if heartbeat is not None:
        heartbeat.stop(keep_file=keep_file)


_FORK_HOOKED: list[str] = []


def beat_in_forked_children(role: str) -> None:
    """Every process forked from this one (and from those) beats on its own, as ``role``
    (a thread does not survive a fork; the parent's beat is not the child's)."""
    if _FORK_HOOKED or not os.environ.get(DIR_VARIABLE):
        return
    _FORK_HOOKED.append(role)
    def child() -> None:
        beat = beat_in_thread(role)
        if beat is not None:
            beat.doing("serving")

    os.register_at_fork(after_in_child=child)
