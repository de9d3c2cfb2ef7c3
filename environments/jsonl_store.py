"""Scored groups as JSONL: one group per line.

Writing: :class:`GroupWriter` appends complete lines with a single ``write`` under an
exclusive ``flock`` (between processes) and a lock of its own (between the threads that
share it: ``flock`` does not exclude two users of one open file), and (by default)
``fsync``s them. A crash can still cut the last write short; the next writer to open the
file finds the torn tail (the bytes after the last newline), moves it to ``FILE.torn``
and truncates it away before appending, so a torn line never sits in the middle of the
file. Readers skip a final line without its newline and report it as torn.

Reading: :func:`read_groups` streams line by line (constant memory);
:func:`iter_located_groups` also gives each group's line number and byte offset, and
:func:`read_group_at` reads one group back from its offset. Each line is a
native :class:`ScoredGroup` or an Atropos ``ScoredData`` object (converted). A bad line
raises :class:`BadLineError` naming its line number, or with ``skip_bad=True`` is
recorded in ``report.bad_lines`` and reading goes on (a line that is not UTF-8 text, e.g.
binary data, is one such bad line).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pydantic import ValidationError

from environments.trajectory import ScoredData, ScoredGroup, TrajectoryError, field_path


class BadLineError(ValueError):
    def __init__(self, path: Path, line_no: int, message: str):
        self.path, self.line_no, self.message = path, line_no, message
        super().__init__(f"{path}:{line_no}: {message}")


@dataclass
class BadLine:
    line_no: int
    message: str
    path: Path | None = None
    """The file the line is in."""


@dataclass
class ReadReport:
    """What a read found besides the groups: bad lines (skipped) and a torn tail."""

    lines: int = 0
    """Lines read (over every file read with this report)."""
    groups: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)


def parse_group_line(line: bytes) -> ScoredGroup:
    """One JSONL line -> ScoredGroup (native form, or Atropos ``ScoredData``)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        _check_utf8(line)  # binary data: say so, rather than orjson's "surrogates" message
        raise
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    if "trajectories" in data:
        return ScoredGroup.model_validate_json(line)
    return ScoredGroup.from_scored_data(ScoredData.model_validate_json(line))


def _check_utf8(line: bytes) -> None:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 text: byte 0x{line[error.start]:02x} at byte "
                         f"{error.start + 1} of the line (binary data? a JSONL line is "
                         "UTF-8 JSON)") from None


def _describe(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = field_path(first["loc"])
        return f"{where + ': ' if where else ''}{first['msg']}"
    if isinstance(error, orjson.JSONDecodeError):
        return f"malformed JSON ({error})"
    return str(error)


@dataclass(frozen=True)
class LocatedGroup:
    """A group and where it sits in its file (``offset``/``size`` in bytes, newline included)."""

    line_no: int
    offset: int
    size: int
    group: ScoredGroup
    path: Path


def iter_located_groups(path: str | Path, *, skip_bad: bool = False,
                        report: ReadReport | None = None) -> Iterator[LocatedGroup]:
    """Stream the groups of a JSONL file with their line numbers and byte offsets."""
    path = Path(path)
    report = report if report is not None else ReadReport()
    offset = 0
    with path.open("rb") as f:
        for line_no, line in enumerate(f, start=1):
            report.lines += 1
            start, offset = offset, offset + len(line)
            if not line.endswith(b"\n"):
                problem = BadLine(line_no, "torn final line (no newline): an interrupted write",
                                  path)
            elif not line.strip():
                continue
            else:
                try:
                    group = parse_group_line(line)
                except (ValueError, TrajectoryError) as error:
                    problem = BadLine(line_no, _describe(error), path)
                else:
                    report.groups += 1
                    yield LocatedGroup(line_no, start, len(line), group, path)
                    continue
            if not skip_bad:
                raise BadLineError(path, problem.line_no, problem.message)
            report.bad_lines.append(problem)


def read_groups(path: str | Path, *, skip_bad: bool = False,
                report: ReadReport | None = None) -> Iterator[ScoredGroup]:
    """Stream the groups of a JSONL file."""
    for located in iter_located_groups(path, skip_bad=skip_bad, report=report):
        yield located.group


def read_group_at(path: str | Path, offset: int, size: int) -> ScoredGroup:
    """The group of the line at byte ``offset`` (as given by :func:`iter_located_groups`)."""
    with Path(path).open("rb") as f:
        f.seek(offset)
        return parse_group_line(f.read(size))


def repair_torn_tail(path: str | Path) -> int:
    """Move bytes after the last newline to ``PATH.torn``; return how many were moved."""
    path = Path(path)
    with path.open("r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        return _repair_locked(f, path)


def _repair_locked(f, path: Path) -> int:
    size = f.seek(0, os.SEEK_END)
    if size == 0:
        return 0
    # Scan back for the last newline, a block at a time.
    end = size
    while end > 0:
        start = max(0, end - 65536)
        f.seek(start)
        block = f.read(end - start)
        at = block.rfind(b"\n")
        if at >= 0:
            keep = start + at + 1
            break
        end = start
    else:
        keep = 0
    if keep == size:
        return 0
    f.seek(keep)
    torn = f.read()
    with open(f"{path}.torn", "ab") as sidecar:
        sidecar.write(torn + b"\n")
    f.truncate(keep)
    f.flush()
    os.fsync(f.fileno())
    return size - keep


class GroupWriter:
    """Appends groups to a JSONL file, crash-safely (see the module docstring)."""

    def __init__(self, path: str | Path, *, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._f = open(self.path, "a+b")
        self._lock = threading.Lock()

    def append(self, groups: ScoredGroup | Iterable[ScoredGroup]) -> None:
        if isinstance(groups, ScoredGroup):
            groups = [groups]
        data = b"".join(g.model_dump_json().encode() + b"\n" for g in groups)
        if not data:
            return
        with self._lock:
            self._append_locked(data)

    def _append_locked(self, data: bytes) -> None:
        fcntl.flock(self._f, fcntl.LOCK_EX)
        try:
            _repair_locked(self._f, self.path)  # a crashed writer's torn line goes first
            self._f.seek(0, os.SEEK_END)
            view = memoryview(data)
            while view:  # a regular file takes it all at once; loop in case it doesn't
                view = view[os.write(self._f.fileno(), view):]
            if self.fsync:
                os.fsync(self._f.fileno())
        finally:
            fcntl.flock(self._f, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._lock:
            self._f.close()

    def __enter__(self) -> GroupWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
