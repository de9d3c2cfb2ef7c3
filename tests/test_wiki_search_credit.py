"""Study 4's independent check (experiments/wiki_search_credit_check.py) against the
runner's report (experiments/wiki_search_credit.py --report) on a synthetic, complete
registered grid: the grid is driven through the runner's own ``next_cell``, each RL cell
kept by the runner's ``keep_rl`` from synthetic evaluation episodes (every held-out item 4
times), each attempt's manifest line as ``run_one`` writes it. The runs themselves (SFT,
vLLM, the trainer) are replaced by outcomes; the study's own results are not read."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import time

import pytest
from test_stress import REPO, load
from third_party import statcheck_python

ITEMS = {"one_hop": 45, "two_hop": 34}
# per candidate seed: held-out tool-call probability per horizon (None: fails 3 times);
# seed 12 is outside the band at two hops, 13 fails: ws1 = seed 11, ws2 = seed 14
CANDIDATES = {11: (0.5, 0.6), 12: (0.5, 0.97), 13: None, 14: (0.4, 0.7)}
FAILED = {"tuning/two_hop/lr1e-05/grpo_merged-seed900",
          "confirmation/one_hop/ws2/grpo_merged-seed421"}
GAIN = {"grpo": 0.0, "grpo_merged": 0.05, "mt_grpo": 0.25, "mt_grpo_unbiased": 0.1}
BEST_LR = {"grpo": 4e-5, "grpo_merged": 1e-5, "mt_grpo": 1.6e-4, "mt_grpo_unbiased": 4e-5}
COMMIT, PACKAGES = "a1b2c3d" + "0" * 33, "# Python 3.12 x86_64\nnumpy==2.0\n"


def episodes(rng, horizon, tool_calls, exact):
    """Evaluation groups (the env's eval file): every held-out item 4 times."""
    groups = []
    for item in range(ITEMS[horizon]):
        trajectories = []
        for _ in range(4):
            call = rng.random() < tool_calls
            success = call and rng.random() < 0.8
            hit = rng.random() < exact * (1.0 if success else 0.3)
            trajectories.append({
                "metadata": {"metrics": {"tool_calls": float(call), "tool_success": float(success),
                                         "exact_match": float(hit)}},
                "masks": [0, 0, -100], "turn_spans": [[0, 1]] * (2 if call else 1),
                "messages": [{"role": "assistant",
                              "content": "<tool_call>{}</tool_call>" if call else "x"}]})
        groups.append({"item_id": f"{horizon}-{item}", "metadata": {"answers": ["a"]},
                       "trajectories": trajectories})
    return groups


def write_episodes(path, groups):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(g) + "\n" for g in groups))


def synthetic_grid(wc, results, tmp_path):
    """The registered design's whole grid, driven through the runner's ``next_cell``."""
    design = wc.Design()
    runs_dir = tmp_path / "runs"
    rng = random.Random(76)
    pilot = json.loads((wc.wp.RESULTS / "warm-start" / "sft64" / "summary.json").read_text())
    digest = hashlib.sha256(PACKAGES.encode()).hexdigest()
    (results / "packages").mkdir(parents=True)
    (results / "packages" / f"{digest}.txt").write_text(PACKAGES)
    rates = {}  # warm-start seed -> horizon -> its held-out tool-call probability

    def record(cell, outcome, config, **extra):
        wc.cf.record(results, {
            "cell": cell.id, "stage": cell.stage, "warm_start": cell.ws, "arm": cell.arm,
            "seed": cell.seed, "lr": cell.lr, "commit": COMMIT, "dirty": False,
            "packages_sha256": digest, "horizon": cell.horizon,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra,
            "config": config, "outcome": outcome, "seconds": 1.0})

    stopped_once = False
    while (cell := wc.next_cell(results, design)) is not None:
        if cell.stage == "warm-start":
            config = wc.wp.warm_start_config(runs_dir, "sft64", cell.ws).model_dump(mode="json")
            calls = (0.45, 0.4) if cell.ws == 1 else CANDIDATES[cell.ws]
            if calls is None:
                record(cell, "failed", config, error="synthetic")
                continue
            rates[cell.ws] = dict(zip(wc.HORIZONS, calls))
            evaluation = {}
            for h in wc.HORIZONS:
                path = tmp_path / "eval" / f"{cell.ws}-{h}.jsonl"
                write_episodes(path, episodes(rng, h, rates[cell.ws][h], 0.2))
                found = wc.wp.rates(wc.wsp.episodes(path))
                found.update(call_attempt_rate=wc.wp.attempt_rate(path), failed=0,
                             mean_outcome=round(rng.uniform(0.2, 0.5), 4))
                found["in_band"] = 0.3 <= found["tool_call_rate"] <= 0.9
                evaluation[h] = found
            wc.wp.keep_json(results / cell.id, {
                "seed": cell.ws, "recipe": "sft64",
                "sha256": pilot["sha256"] if cell.ws == 1 else f"{cell.ws:064x}",
                "sft_steps": [{"step": i, "loss": 2.0 / i} for i in (1, 2, 3)],
                "evaluation": evaluation, "band": [0.3, 0.9],
                "in_band": all(e["in_band"] for e in evaluation.values())})
            record(cell, "finished", config)
            continue
        ws_cell = wc.warm_start_of(results, cell)
        start = json.loads((results / ws_cell.id / "summary.json").read_text())
        model = wc.wp.warm_start_path(runs_dir, "sft64", start["seed"])
        config = wc.rl_config(argparse.Namespace(runs_dir=runs_dir), design, cell, str(model))
        extra = {"warm_start_cell": ws_cell.id, "warm_start_sha256": start["sha256"]}
        dumped = config.model_dump(mode="json")
        if cell.id in FAILED:
            record(cell, "failed", dumped, error="synthetic", **extra)
            continue
        if not stopped_once:
            stopped_once = True
            record(cell, "stopped", dumped, **extra)
        run_dir = tmp_path / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        (run_dir / "trainer").mkdir(parents=True)
        (run_dir / "trainer" / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "env/exact_match": 0.1}) + "\n" for i in range(1, 33)))
        # GRPO-OR calls the tool more than its warm start at one hop (as in the pilot),
        # less at two hops (as the paper predicts)
        calls = rates[start["seed"]][cell.horizon] + (
            (0.2 if cell.horizon == "one_hop" else -0.15) if cell.arm == "grpo" else 0.1)
        exact = 0.15 + GAIN[cell.arm] + (0.05 if cell.horizon == "one_hop" else 0.0)
        write_episodes(run_dir / "eval" / "after-wiki_search.jsonl",
                       episodes(rng, cell.horizon, min(calls, 1.0), exact))
        outcome = round(exact - 0.05 * abs(math.log(cell.lr / BEST_LR[cell.arm]))
                        + rng.uniform(-0.01, 0.01), 4)
        wc.wp.keep_rl(run_dir, results / cell.id, {
            "after": {"wiki_search": {"mean_outcome": outcome, "failed": 0}}, "seconds": 1.0})
        record(cell, "finished", dumped, **extra)
    return design


def check(report, results):
    done = subprocess.run(
        [str(statcheck_python()), str(REPO / "experiments" / "wiki_search_credit_check.py"),
         "--report", str(report), "--results", str(results), "--commit", COMMIT[:7]],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    return done.returncode, done.stdout + done.stderr


def differs(out):
    return [x for x in out.splitlines() if x.startswith("DIFFERS")]


def test_the_independent_check_agrees_with_the_report_and_finds_what_differs(tmp_path,
                                                                            monkeypatch):
    """``experiments/wiki_search_credit_check.py`` (numpy, scipy, statsmodels, in a venv of
    their own) on the runner's report of a synthetic registered grid: every number agrees;
    one run's exact match changed in the report, a tuning run's mean outcome changed in
    the kept files (so that the rule would choose another rate), and a run that packed its
    micro-batches otherwise than deviation 1 says, are found and named."""
    try:
        statcheck_python()
    except Exception as error:  # no PyPI: the venv cannot be built
        pytest.skip(f"no venv with numpy, scipy and statsmodels for the check: {error}")
    wc = load("wiki_search_credit")
    results = tmp_path / "results"
    design = synthetic_grid(wc, results, tmp_path)
    assert design.registered
    chosen = json.loads((results / "tuning-choice.json").read_text())["chosen"]
    assert chosen["one_hop"] == BEST_LR  # at two hops grpo_merged's 1e-5 failed 3 times
    assert chosen["two_hop"] == {**BEST_LR, "grpo_merged": 4e-5}
    monkeypatch.setattr(wc, "plot", lambda *args: None)  # no number in it
    report = tmp_path / "report.md"
    report.write_text(wc.report(argparse.Namespace(results=results, out=report), design))
    text = report.read_text()
    assert "| warm-starts/seed14 |" in text and "| ws2 |" in text
    assert "missing (3 failed attempts)" in text and "Tests, equivalence (" in text

    rc, out = check(report, results)
    assert rc == 0, out
    assert "(all match)" in out and not differs(out)
    assert "confirmation grid" in out and "tests" in out

    # one run's final exact match changed in the report's every-run table
    cell = "confirmation/one_hop/ws1/mt_grpo-seed410"
    lines = text.splitlines()
    row = next(i for i, x in enumerate(lines) if x.startswith(f"| {cell} |"))
    exact = lines[row].split("|")[2].split("/")[0].strip()
    lines[row] = lines[row].replace(f"| {exact} /", f"| {float(exact) + 0.01:.3f} /", 1)
    tampered = tmp_path / "tampered.md"
    tampered.write_text("\n".join(lines))
    rc, out = check(tampered, results)
    assert rc == 1, out
    assert len(differs(out)) == 1 and f"{cell} final exact_match" in differs(out)[0], out

    # a tuning run's kept mean outcome raised above its horizon's and arm's best: the rule
    # would now choose that run's rate, not the one tuning-choice.json holds
    arm, horizon = "mt_grpo", "one_hop"
    rate = next(lr for lr in wc.LRS if lr != chosen[horizon][arm])
    other = tmp_path / "other"
    shutil.copytree(results, other)
    path = other / f"tuning/{horizon}/lr{rate:g}/{arm}-seed900/summary.json"
    summary = json.loads(path.read_text())
    summary["after"]["wiki_search"]["mean_outcome"] = 0.99
    path.write_text(json.dumps(summary))
    rc, out = check(report, other)
    assert rc == 1, out
    assert any(f"the rule's rate for {arm} at {horizon}" in x for x in differs(out)), out
    assert any(f"tuning table {horizon} {arm} lr {rate:g} mean outcome" in x
               for x in differs(out)), out

    # deviation 1: a run after the registration commit packed with the trainer's default
    # budget (its config without max_tokens_per_micro_batch), not 4096 tokens
    budget = tmp_path / "budget"
    shutil.copytree(results, budget)
    lines = (budget / "manifest.jsonl").read_text().splitlines()
    row = next(i for i, x in enumerate(lines) if f'"cell": "{cell}"' in x)
    entry = json.loads(lines[row])
    assert entry["config"]["train"].pop("max_tokens_per_micro_batch") == 4096
    lines[row] = json.dumps(entry)
    (budget / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    rc, out = check(report, budget)
    assert rc == 1, out
    assert [x for x in differs(out) if "packed micro-batch tokens" in x] and all(
        cell in x for x in differs(out)), out


def test_the_probe_counts_an_answer_in_the_reply_against_the_episodes_own_item(tmp_path):
    """Several samples per item (the study's evaluations keep 4): each episode is checked
    against its own item's answers, not against the item at its position in the file."""
    wsp = load("wiki_search_probe")
    groups = [{"item_id": item, "metadata": {"answers": [answer]}, "trajectories": [
        {"masks": [0, -100], "messages": [{"role": "assistant", "content": reply}]}
        for reply in replies]}
        for item, answer, replies in [("x", "Paris", ["It is Paris.", "<answer>paris</answer>",
                                                      "Lyon"]),
                                      ("y", "Rome", ["Rome", "no idea", "Paris"])]]
    write_episodes(tmp_path / "eval.jsonl", groups)
    rows = wsp.episodes(tmp_path / "eval.jsonl")
    assert [row["item_id"] for row in rows] == ["x"] * 3 + ["y"] * 3
    assert wsp.answer_anywhere(rows, {"x": ["Paris"], "y": ["Rome"]}) == 3
