"""The CPU each test costs, printed at the end of a session beside pytest's durations.

On two cores `make test` runs three pytest sessions side by side, so a test's wall time
says little about what it costs the others: its CPU does. A test's CPU is that of the
pytest process and of every process it started and reaped (a vLLM server, a `lachesis
run`, a torchrun rank) over its set-up, call and tear-down, and what the processes still
running under pytest (the session's shared vLLM servers) spent meanwhile: the requests a
test sends them count as its own. Loaded by tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

from lachesis.run.processes import tree_cpu_seconds

SHOWN = 15


def _cpu_seconds() -> float:
    # the processes still running under pytest, and what they reaped: what pytest's own
    # accounting gets only when they end
    total = tree_cpu_seconds(os.getpid(), include_root=False, reaped=True)
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


class CPUCost:
    def __init__(self) -> None:
        self.start = _cpu_seconds()
        self.by_test: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.session_end = 0.0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        # (two reads of /proc per test: set-up, call and tear-down together)
        before, started = _cpu_seconds(), time.monotonic()
        self.session_end = 0.0
        yield
        self.by_test[item.nodeid] = _cpu_seconds() - before - self.session_end
        self.wall[item.nodeid] = time.monotonic() - started

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        if nextitem is not None:
            yield
            return
        before = _cpu_seconds()  # the last test's tear-down stops the session's servers
        yield
        self.session_end = _cpu_seconds() - before

    def pytest_terminal_summary(self, terminalreporter):
        if not self.by_test:
            return
        total = _cpu_seconds() - self.start
        write = terminalreporter.write_line
        terminalreporter.section(f"most CPU ({SHOWN}): the test's process and the ones it reaped")
        for nodeid, seconds in sorted(self.by_test.items(), key=lambda kv: -kv[1])[:SHOWN]:
            write(f"{seconds:8.2f}s cpu  {nodeid}")
        if os.environ.get("LACHESIS_TEST_CPU_DIR"):  # every test's, for a closer look
            out = Path(os.environ["LACHESIS_TEST_CPU_DIR"])
            out.mkdir(parents=True, exist_ok=True)
            (out / f"cpu-{os.getpid()}.json").write_text(json.dumps(self.by_test, indent=1))
            # and each test's wall time (set-up, call, tear-down)
            (out / f"wall-{os.getpid()}.json").write_text(json.dumps(self.wall, indent=1))
        in_tests = sum(self.by_test.values())
        write(f"session CPU {total:.0f} s: {in_tests:.0f} s in {len(self.by_test)} tests, "
              f"{total - in_tests:.0f} s outside them (collection, the session's end)")


def register(config) -> None:
    config.pluginmanager.register(CPUCost(), "lachesis-cpu-cost")
