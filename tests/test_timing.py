"""The time budget: every trainer step says in metrics.jsonl where its time went
(``time/*``, trainer/timing.py) and what memory it took (``memory/*``), the env's per-rollout seconds reach the step's metrics,
and the end of ``lachesis run`` turns them into a "where the time went" table."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from test_turn_prefix import trajectory

from environments.jsonl_store import GroupWriter
from environments.trajectory import ScoredGroup
from lachesis.run.report import time_table, write_summary
from trainer.config import TrainConfig
from trainer.timing import PARTS
from trainer.train import train


def test_every_step_logs_where_its_time_went(tiny_model_dir, tmp_path):
    rng = random.Random(0)
    groups = []
    for g in range(4):
        trajs = [trajectory(rng, 2, [0.0, float(i % 2)]) for i in range(4)]
        trajs = [t.model_copy(update={"metadata": {
            **t.metadata, "seconds": {"generation": 1.0 + g, "env": 0.5, "queue_wait": 0.0}}})
            for t in trajs]
        groups.append(ScoredGroup(trajectories=trajs))
    GroupWriter(tmp_path / "g.jsonl").append(groups)
    config = TrainConfig(model=str(tiny_model_dir), data=tmp_path / "g.jsonl",
                         run_dir=tmp_path / "run", batch_size=8, steps=2, lr=1e-4,
                         check_alignment=False, tensorboard=False, checkpoint_every=2)
    asyncio.run(train(config))
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        parts = [r[f"time/{p}"] for p in PARTS]
        assert all(v >= 0 for v in parts)
        assert r["time/train"] > 0 and r["time/step"] >= sum(parts)
        assert r["time/sync"] < r["time/step"]  # no vLLM: nothing to sync
    assert rows[0]["time/checkpoint"] == 0 and rows[1]["time/checkpoint"] > 0  # every 2
    # and what memory it took (trainer/memory.py): the process's resident set at the
    # step's end is inside its peak during the step (the high-water mark reset at its start)
    for r in rows:
        assert 0.05 < r["memory/held_gib"] <= r["memory/peak_gib"] < 64, r
    # the env's per-rollout seconds, averaged over the batch's trajectories (2 groups each)
    assert rows[0]["env/time/generation"] == pytest.approx(1.5)
    assert rows[1]["env/time/generation"] == pytest.approx(3.5)
    assert rows[0]["env/time/env"] == pytest.approx(0.5)

    phases = {"model (warm start)": 10.0, "start-up": 5.0, "training": 20.0,
              "evaluation after": 5.0}
    table = time_table(phases, rows)
    assert "| training | 20.0 | 50% |" in table and "| **total** | 40.0 | |" in table
    train_seconds = sum(r["time/train"] for r in rows)
    assert f"forward, backward, optimizer | {train_seconds:.1f} |" in table
    assert "generation 2.50" in table  # mean of the two batches' means
    # a trainer that waited for its first batch from before the training phase (it starts
    # while vLLM does): that wait is not counted in the training phase's rows
    waited = [{**rows[0], "time/batch_wait": rows[0]["time/batch_wait"] + 30.0,
               "time/step": rows[0]["time/step"] + 30.0}, rows[1]]
    early = time_table({**phases, "training": sum(r["time/step"] for r in rows) + 2.0}, waited)
    batch_wait = sum(r["time/batch_wait"] for r in rows) + 2.0
    assert f"waiting for batches | {batch_wait:.1f} |" in early
    written = write_summary(tmp_path / "run", {"phases": phases},
                            tmp_path / "run/metrics.jsonl")
    assert written["time_table"] == table
    assert table in (tmp_path / "run/summary.md").read_text()


def test_where_the_time_went_adds_up_to_the_wall_time_hangs_included():
    """The training phase's rows add up to it (waits on a silent process and the
    trainer's own hang among them, steps of an earlier start of a resumed run left out),
    and the phases to the total, the run's wall time. No model: 0.01 s."""
    def step(at, **parts):
        values = {f"time/{p}": parts.get(p, 0.0) for p in PARTS}
        return {"step": 0, "logged_at": at, **values,
                "time/step": sum(values.values()) + parts.get("rest", 0.0)}

    rows = [step(50.0, batch_wait=9.0, train=1.0),  # logged by the start before a resume
            step(110.0, batch_wait=4.0, prepare=1.0, train=2.0, sync=1.0, rest=0.5),
            step(150.0, batch_wait=1.0, train=2.0, hang_wait=30.0, checkpoint=1.5),
            step(190.0, train=2.0, sync=0.5, hang_wait=4.5, rest=0.5)]
    phases = {"model (warm start)": 3.0, "start-up": 40.0, "training": 100.0,
              "accounting, stopping the env servers": 2.0, "evaluation after": 5.0}
    table = time_table(phases, rows, {"started_at": 100.0, "ended_at": 200.0,
                                      "trainer_hung_s": 20.0})
    figures = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[1].replace(".", "").isdigit():
            figures[cells[0].replace("&nbsp;", "")] = float(cells[1])
    parts = {k: v for k, v in figures.items() if k not in phases and k != "**total**"}
    assert parts == {
        "waiting for batches": 5.0, "advantages, packing": 1.0,
        "forward, backward, optimizer": 6.0, "weight syncs": 1.5, "checkpoints": 1.5,
        # the steps' own waits on silent processes, and the trainer's hang (its step lost)
        "waiting on a process that did not answer": 34.5 + 20.0,
        "rest of the 3 steps": 1.0,
        "outside the steps (the trainer's start, restarts and the steps they lost)":
            100.0 - 50.5 - 20.0}
    assert sum(parts.values()) == pytest.approx(phases["training"])
    assert figures["**total**"] == sum(phases.values()) == 150.0


def test_the_summary_shows_the_same_held_out_items_before_and_after(tmp_path):
    """Sample transcripts pair each item's first episode before RL with its first
    episode after: items whose outcome changed first, in the order the evaluation wrote
    them, then the others; an item evaluated only once is not shown. The page of every
    evaluation episode is written beside them."""
    def group(item: str, turns: list[dict], scores: list[float]) -> str:
        messages = [{"role": "system", "content": "Solve it."},
                    {"role": "user", "content": f"question {item}"}, *turns]
        return json.dumps({"item_id": item, "env": "arithmetic_tool", "trajectories": [
            {"tokens": [1, 2, 3], "masks": [-100, 2, 3], "scores": scores,
             "messages": messages}]}) + "\n"

    direct = [{"role": "assistant", "content": "<answer>381</answer>"}]
    called = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type":
               "function", "function": {"name": "calculator", "arguments": {
                   "expression": "17 * 23"}}}]},
              {"role": "tool", "content": "391"},
              {"role": "assistant", "content": "<answer>391</answer>"}]
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "before-env.jsonl").write_text(
        group("same", called, [1.0, 1.0]) + group("a", direct, [0.1])
        + group("b", direct, [0.1]) + group("only-before", direct, [0.1]))
    (run / "eval" / "after-env.jsonl").write_text(
        group("b", called, [1.0, 1.0]) + group("a", called, [1.0, 1.0])
        + group("same", called, [1.0, 1.0]))
    written = write_summary(run, {}, run / "metrics.jsonl")
    [text] = written["transcripts"]
    assert text.index("**question a**") < text.index("**question b**") \
        < text.index("**question same**")
    assert "among the 2 of 3 whose outcome changed" in text
    assert "only-before" not in text
    assert ("--- before RL [0.1]\nassistant: <answer>381</answer>\n--- after RL [1.0, 1.0]\n"
            'assistant: <tool_call>{"name": "calculator", "arguments": {"expression": '
            '"17 * 23"}}</tool_call>\ntool: 391\nassistant: <answer>391</answer>') in text
    assert text in (run / "summary.md").read_text()
    assert (run / "eval" / "report.html").stat().st_size > 1000
