"""Each catalog harness as shipped (the pinned versions, installed by this test's set-up
into the harness cache from npm and PyPI), run end to end on the real proxy and vLLM CPU
by benchmarks/harness_table.py: the harness reaches its own end, every model call it
made is a recorded turn, its shell-tool call ran in the bwrap sandbox (answer.txt graded
host-side), one segment per rollout, and the trainer's alignment check passes on the
groups and a training step runs on them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from harness_table import EPISODE, ROWS, SEGMENTS, row_wire_api  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.needs("bubblewrap", "npm", "nodejs", "python3-venv"),
              pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap is Linux-only")]


# One harness per wire API in `make test` (Pi: Chat Completions, Codex: Responses, Claude
# Code: Messages, Gemini CLI: Gemini): three of them took 86 s alone here, 93 s CPU,
# against 237 s for the seven rows of then beside the rest of the suite; `make test-all`
# runs the other rows too.
QUICK = ["pi", "codex", "claude-code", "gemini-cli"]


@pytest.mark.parametrize("rows", [
    pytest.param(QUICK, id="one-per-wire-api"),
    pytest.param([r for r in ROWS if r not in QUICK], id="the-others",
                 marks=pytest.mark.slow)])
def test_every_catalog_harness_runs_as_shipped_through_the_proxy_and_trains(tmp_path, rows):
    done = subprocess.run(
        [sys.executable, "benchmarks/harness_table.py", "--harness", *rows, "--group-size",
         "1", "--parallel", "2", "--timeout-s", "240", "--work", str(tmp_path / "work"),
         "--json", str(tmp_path / "table.json")],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert (tmp_path / "table.json").exists(), done.stderr[-3000:]
    summary = json.loads((tmp_path / "table.json").read_text())
    rows_by_name = {row["harness"]: row for row in summary["rows"]}
    assert set(rows_by_name) == set(rows), done.stdout
    for name, row in rows_by_name.items():
        wire_api = row_wire_api(name)
        assert row["exit"] == 0 and row["rollouts"] == 1, (name, row["stderr_tail"])
        assert row["reached_end"] == [True], (name, row)  # the harness exited 0 itself
        assert row["wire_apis"] == [wire_api], (name, row)
        turns, tool_results = EPISODE.get(name, (2, 1))
        assert row["turns"] == [turns] and row["tool_results"][0] >= tool_results, (name, row)
        # each call extended the last (OpenClaw: its runtime context moves to the end)
        assert row["segments"] == [SEGMENTS.get(name, 1)], (name, row)
        assert row["solved"] == [True], (name, row)  # its call ran in the sandbox
    assert summary["check_exit"] == 0, summary["check"]
    assert summary["step_exit"] == 0, summary["step"]
    assert done.returncode == 0, done.stdout
