"""Live progress of a run: the trainer's latest metrics and the rollout API's queue.

On a terminal a ``rich`` panel refreshes in place; in logs and pipes one line is printed
per new trainer step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def last_metrics(path: Path) -> dict[str, Any] | None:
    """The last complete line of a ``metrics.jsonl`` (None when there is none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # a line being written
    return None


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class RunProgress:
    def __init__(self, name: str, total_steps: int, *, live: bool | None = None):
        self.name = name
        self.total_steps = total_steps
        self.live = sys.stdout.isatty() if live is None else live
        self._rich = None
        self._last_printed_step = None
        self.phase = "starting"
        self.processes: dict[str, str] = {}

    def __enter__(self) -> RunProgress:
        if self.live:
            from rich.live import Live

            self._rich = Live(self._render({}, {}), refresh_per_second=2, transient=False)
            self._rich.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
            self._rich = None

    def message(self, text: str) -> None:
        if self._rich is not None:
            self._rich.console.print(text)
        else:
            print(text, flush=True)

    def update(self, metrics: dict[str, Any] | None, api_status: dict[str, Any] | None) -> None:
        metrics, api_status = metrics or {}, api_status or {}
        if self._rich is not None:
            self._rich.update(self._render(metrics, api_status))
            return
        step = metrics.get("step")
        if step is not None and step != self._last_printed_step:
            self._last_printed_step = step
            print(self._line(metrics, api_status), flush=True)

    def _values(self, m: dict[str, Any], s: dict[str, Any]) -> list[tuple[str, str]]:
        return [
            ("step", f"{m.get('step', 0)}/{self.total_steps}"),
            ("reward", _fmt(m.get("reward_mean"), ".3f")),
            ("tool success", _fmt(m.get("env/tool_success"), ".2f")),
            ("accuracy", _fmt(m.get("env/correct"), ".2f")),
            ("tokens/s", _fmt(m.get("tokens_per_second"), ".0f")),
            ("queue", _fmt(s.get("queue_size"), "d")),
            ("policy", _fmt(s.get("policy_version"), "d")),
        ]

    def _line(self, m: dict[str, Any], s: dict[str, Any]) -> str:
        return f"[{self.name}] " + "  ".join(f"{k} {v}" for k, v in self._values(m, s))

    def _render(self, m: dict[str, Any], s: dict[str, Any]):
        from rich.table import Table

        table = Table(title=f"lachesis run {self.name} — {self.phase}", title_justify="left")
        values = self._values(m, s)
        for key, _ in values:
            table.add_column(key, justify="right")
        table.add_row(*(v for _, v in values))
        status = Table.grid(padding=(0, 2))
        status.add_row(*(f"{name}: {state}" for name, state in self.processes.items()))
        outer = Table.grid()
        outer.add_row(table)
        outer.add_row(status)
        return outer
