"""Study 3's runner (experiments/textworld_credit.py): the registered grid, the warm starts
chosen by their band, the learning-rate rule applied once, a cell's record, and the
registered tests against independent implementations. The runs themselves (SFT, vLLM,
the trainer: minutes each) are replaced by their outcomes; the study runs them for real."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import time

import pytest
from test_confirmatory import fake_runs
from test_stress import REPO, holm_rejects, load, permutation_p_by_enumeration, t_sf_by_integration
from third_party import statcheck_python


def write_warm_start(results, horizon, seed, success):
    kept = results / "warm-starts" / horizon / f"seed{seed}"
    kept.mkdir(parents=True, exist_ok=True)
    (kept / "model.safetensors").write_bytes(f"weights {horizon} {seed}".encode())
    tw = load("textworld_credit")
    (kept / "summary.json").write_text(json.dumps({
        "seed": seed, "horizon": horizon, "demonstrator": {"epsilon": 0.5},
        "sft_loss": {"last10_mean": 0.5},
        "in_band": tw.BANDS[horizon][0] <= success <= tw.BANDS[horizon][1],
        "evaluation": {"success": success, "success_ci95": [success - 0.05, success + 0.05]},
        "sha256": tw.cf.weights_hash(str(kept))}))


def write_run(results, cell, success):
    (results / cell.id / "trainer").mkdir(parents=True, exist_ok=True)
    (results / cell.id / "trainer" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "env/won": success * i / 3}) + "\n" for i in (1, 2, 3)))
    (results / cell.id / "summary.json").write_text(json.dumps(
        {"after": {"textworld_cooking": {"success": success}}}))


def test_the_registered_design():
    tw = load("textworld_credit")
    design = tw.Design()
    assert design.registered
    tuning = tw.tuning_cells(design)
    confirmation = tw.confirmation_cells(design, {arm: 3e-4 for arm in tw.ARMS})
    short, long = tw.HORIZON_DESIGN["short"], tw.HORIZON_DESIGN["long"]
    assert len(tuning) == len(tw.ARMS) * len(tw.LRS) * len(tw.TUNING_SEEDS)
    assert {c.horizon for c in tuning} == {"short"} and {c.ws for c in tuning} == {0}
    assert len(confirmation) == tw.WARM_STARTS * (len(short["arms"]) * short["runs"]
                                                 + len(long["arms"]) * long["runs"])
    seeds = {c.seed for c in confirmation}
    assert not seeds & {c.seed for c in tuning}
    for horizon in ("short", "long"):
        for ws in range(1, tw.WARM_STARTS + 1):  # every arm on the same seeds
            per_arm = [{c.seed for c in confirmation if (c.horizon, c.ws, c.arm) == (
                horizon, ws, arm)} for arm in tw.HORIZON_DESIGN[horizon]["arms"]]
            assert len(per_arm[0]) == tw.HORIZON_DESIGN[horizon]["runs"]
            assert all(s == per_arm[0] for s in per_arm)
    # cut short, the study stays balanced: run index 0 of every horizon, warm start, arm first
    first = len(short["arms"]) * tw.WARM_STARTS + len(long["arms"]) * tw.WARM_STARTS
    assert {(c.horizon, c.ws, c.arm) for c in confirmation[:first]} == {
        (h, ws, arm) for h in ("short", "long") for ws in range(1, tw.WARM_STARTS + 1)
        for arm in tw.HORIZON_DESIGN[h]["arms"]}
    assert set(tw.CREDIT_ARMS) | set(tw.BASELINES) == set(tw.ARMS)


def test_the_grid_picks_warm_starts_by_their_band_and_the_rate_once(tmp_path):
    tw = load("textworld_credit")
    design = tw.Design(lrs=(1e-4, 3e-4), tuning_seeds=(300,), arms=("grpo", "mt_grpo"),
                       runs={"short": 2, "long": 1})
    results = tmp_path
    assert tw.next_cell(results, design) == tw.Cell("warm-start", "short", 0)
    write_warm_start(results, "short", 0, 0.70)  # the tuning warm start: no band
    tuning = tw.tuning_cells(design)
    success = {("grpo", 1e-4): 0.5, ("grpo", 3e-4): 0.5, ("mt_grpo", 1e-4): 0.4,
               ("mt_grpo", 3e-4): 0.6}
    for cell in tuning:
        assert tw.next_cell(results, design) == cell
        write_run(results, cell, success[cell.arm, cell.lr])
    # short candidates 1..: seed 2 is outside the band and skipped, seed 3 fails for good
    assert tw.next_cell(results, design) == tw.Cell("warm-start", "short", 1)
    choice = json.loads((results / "tuning-choice.json").read_text())
    assert choice["chosen"] == {"grpo": 1e-4, "mt_grpo": 3e-4}  # a tie goes to the smaller
    write_run(results, tuning[0], 0.0)  # written once: a changed result moves nothing
    for seed, value in [(1, 0.30), (2, 0.60)]:
        write_warm_start(results, "short", seed, value)
    assert tw.next_cell(results, design) == tw.Cell("warm-start", "short", 3)
    for _ in range(tw.MAX_ATTEMPTS):
        tw.cf.record(results, {"cell": "warm-starts/short/seed3", "outcome": "failed"})
    for seed in (4, 5, 6):
        write_warm_start(results, "short", seed, 0.40)
    assert tw.confirmation_warm_starts(results, "short") == ([1, 4, 5, 6], None)
    assert tw.next_cell(results, design) == tw.Cell("warm-start", "long", 1)
    for seed in (1, 2, 3):
        write_warm_start(results, "long", seed, 0.2)
    # the long horizon has 3 of its 4: no RL cell starts before every warm start is made
    assert tw.next_cell(results, design) == tw.Cell("warm-start", "long", 4)
    for seed in range(4, tw.MAX_CANDIDATES + 1):
        write_warm_start(results, "long", seed, 0.9)  # none more inside the band
    assert tw.confirmation_warm_starts(results, "long") == ([1, 2, 3], None)
    order = []
    while (cell := tw.next_cell(results, design)) is not None:
        order.append((cell.horizon, cell.ws, cell.arm, cell.seed, cell.lr))
        write_run(results, cell, 0.5)
    assert order[:2] == [("short", 1, "grpo", 400, 1e-4), ("short", 1, "mt_grpo", 400, 3e-4)]
    assert len(order) == 4 * 2 * 2 + 3 * 2  # the long horizon's ws4 is missing
    assert tw.warm_start_of(results, tw.Cell("confirmation", "short", 2, "grpo", 411)) == \
        tw.Cell("warm-start", "short", 4)
    assert tw.choose(results, design)["chosen"] == {"grpo": 1e-4, "mt_grpo": 3e-4}


def test_a_cell_records_its_identity_and_runs_from_its_checked_warm_start(tmp_path, monkeypatch):
    tw = load("textworld_credit")
    design = tw.Design()
    results = tmp_path / "results"
    args = argparse.Namespace(runs_dir=tmp_path / "runs", results=results)
    made = tmp_path / "made" / "final"
    made.mkdir(parents=True)
    (made / "model.safetensors").write_bytes(b"weights")
    (made / "trainer_state.pt").write_bytes(b"optimizer")
    monkeypatch.setattr(tw, "make_warm_start", lambda args, cell: {
        "seed": cell.ws, "model": str(made), "demonstrator": {"epsilon": 0.5},
        "warm_start_seconds": 1.0, "evaluation_seconds": 1.0, "sft_loss": {},
        "evaluation": {"success": 0.4}})
    assert tw.run_one(args, design, tw.Cell("warm-start", "short", 0)) == "finished"
    kept = results / "warm-starts" / "short" / "seed0"
    assert (kept / "model.safetensors").exists() and not (kept / "trainer_state.pt").exists()
    warm = tw.cf.read_manifest(results)[0]["config"]["warm_start"]
    assert warm["settings"]["seed"] == 100 and warm["train"]["seed"] == 0
    monkeypatch.setattr(tw, "run_quietly", fake_runs([KeyboardInterrupt(),
                                                      {"seconds": 3.0, "after": {}}]))
    cell = tw.tuning_cells(design)[4]
    with pytest.raises(KeyboardInterrupt):
        tw.run_one(args, design, cell)
    assert tw.run_one(args, design, cell) == "finished"
    entry = tw.cf.read_manifest(results)[-1]
    assert [e["outcome"] for e in tw.cf.read_manifest(results)] == ["finished", "stopped",
                                                                   "finished"]
    assert entry["cell"] == cell.id and entry["horizon"] == "short" and len(entry["commit"]) == 40
    assert entry["warm_start_sha256"] == json.loads((kept / "summary.json").read_text())["sha256"]
    train, env = entry["config"]["train"], entry["config"]["envs"][0]["settings"]
    assert (train["estimator"], train["lr"], train["seed"]) == (cell.arm, cell.lr, cell.seed)
    assert train["steps"] == tw.HORIZON_DESIGN["short"]["steps"]
    assert env["seed"] == 1000 + cell.seed and env["horizon"] == "short"
    assert env["eval_items"] == tw.HORIZON_DESIGN["short"]["eval_items"]
    assert entry["config"]["evaluate_before"] is False
    long = tw.rl_config(args, design, tw.Cell("confirmation", "long", 1, "gigpo", 500, 1e-3),
                        "model")
    assert long.envs[0].settings["horizon"] == "long" and long.train["estimator"] == "gigpo"
    tw.check_design(args, design)
    (kept / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(SystemExit, match="not the recorded"):
        tw.warm_start_model(argparse.Namespace(runs_dir=tmp_path / "fresh", results=results),
                            tw.Cell("warm-start", "short", 0))


def welch_interaction(long_x, long_y, short_x, short_y):
    """(stratified difference at the long horizon) − (at the short), its variance the sum
    of the two, each Σ_s (s²_x/n_x + s²_y/n_y)/S²; Welch-Satterthwaite df over the eight
    variance terms; two-sided p from Student's t by integration."""
    terms, d = [], 0.0
    for sign, xs, ys in ((1, long_x, long_y), (-1, short_x, short_y)):
        d += sign * statistics.mean(statistics.mean(a) - statistics.mean(b)
                                    for a, b in zip(xs, ys))
        terms += [(statistics.variance(v) / len(v) / len(xs) ** 2, len(v) - 1)
                  for a, b in zip(xs, ys) for v in (a, b)]
    var = sum(t for t, _ in terms)
    df = var**2 / sum(t**2 / k for t, k in terms)
    return d, 2 * t_sf_by_integration(abs(d) / math.sqrt(var), df)


def test_registered_tests_against_independent_implementations(tmp_path):
    tw = load("textworld_credit")
    design = tw.Design(lrs=(3e-4,), runs={"short": 2, "long": 2})
    results = tmp_path
    write_warm_start(results, "short", 0, 0.4)
    for cell in tw.tuning_cells(design):
        write_run(results, cell, 0.5)
    tw.next_cell(results, design)
    for horizon in ("short", "long"):
        for seed in range(1, 5):
            write_warm_start(results, horizon, seed, (0.3 if horizon == "short" else 0.1)
                             + seed / 100)
    rng = random.Random(1)
    gain = {"grpo": 0.0, "grpo_merged": 0.02, "mt_grpo": 0.08, "mt_grpo_unbiased": 0.1,
            "turn_rtg": 0.04, "gigpo": -0.42}
    written = {}
    while (cell := tw.next_cell(results, design)) is not None:
        base = 0.4 + cell.ws / 50 + (gain[cell.arm] if cell.horizon == "long" else 0.0)
        written[cell] = round(base + rng.uniform(-0.05, 0.05), 3)
        write_run(results, cell, written[cell])
    chosen = tw.choose(results, design)["chosen"]
    rows = tw.run_rows(results, design, chosen)
    tests = tw.registered_tests(rows)
    primary = tests["primary: long, success"]
    assert len(primary) == 8
    for name, t in primary.items():
        arm, base = name.split(" - ")
        x, y = tw.strata(rows["long"], arm, base, "success")
        d, p = permutation_p_by_enumeration(x, y)  # 6^4 relabellings: exact in both
        assert t["difference"] == pytest.approx(d) and t["p"] == pytest.approx(p)
    assert holm_rejects({k: t["p"] for k, t in primary.items()}, 0.05) == {
        k for k, t in primary.items() if t["holm"] <= 0.05}
    assert primary["gigpo - grpo"]["p"] == pytest.approx(2 / 6**4)
    assert primary["gigpo - grpo"]["holm"] <= 0.05
    # collapse: final success more than 0.10 below the warm start's (0.1 + k/100 long)
    def collapsed(arm, ws):
        runs = [v for c, v in written.items() if (c.horizon, c.arm, c.ws) == ("long", arm, ws)]
        return statistics.mean(v < 0.1 + ws / 100 - 0.10 for v in runs)

    expected = statistics.mean(collapsed("gigpo", ws) - collapsed("grpo", ws) for ws in range(1, 5))
    assert expected > 0
    assert tests["long, collapse"]["gigpo - grpo"]["difference"] == pytest.approx(expected)
    assert tests["short, collapse"]["gigpo - grpo"]["difference"] == 0.0
    for arm in tw.CREDIT_ARMS:
        d, p = welch_interaction(*tw.strata(rows["long"], arm, "grpo_merged", "success"),
                                 *tw.strata(rows["short"], arm, "grpo_merged", "success"))
        got = tests["interaction"][f"{arm} - grpo_merged"]
        assert got["difference"] == pytest.approx(d) and got["p"] == pytest.approx(p, abs=1e-6)
    text = tw.report(argparse.Namespace(results=results, out=tmp_path / "report.md"), design)
    assert "| long | 4 | 0.500 | 0.500 | 0.140 [0.090, 0.190] | yes | ws4 |" in text
    assert "Tests, primary: long, success" in text and "| gigpo - grpo | -" in text
    assert (tmp_path / "report.png").stat().st_size > 0


# --- the independent check (experiments/textworld_credit_check.py) ----------------------------

# the synthetic grid: each warm start's wins of the 256 held-out games (None: failed 3
# times); short seed 2 and long seed 4 are outside their bands, long seed 2 fails
WARM_START_WINS = {"short": {0: 80, 1: 90, 2: 160, 3: 100, 4: 95, 5: 110},
                   "long": {1: 40, 2: None, 3: 30, 4: 10, 5: 50, 6: 35}}
FAILED_RUNS = {"confirmation/long/ws1/grpo-seed500",
               "confirmation/long/ws2/mt_grpo_unbiased-seed511",
               "confirmation/long/ws3/turn_rtg-seed522", "confirmation/long/ws4/gigpo-seed530",
               "confirmation/short/ws2/turn_rtg-seed411"}


def registered_grid(tw, results, monkeypatch):
    """The registered design's whole grid driven through the runner's own ``next_cell``,
    each attempt's manifest line as ``run_one`` writes it and each cell's files as kept,
    the runs replaced by outcomes (shares of 256 games). Some cells fail 3 times: at the
    long horizon one of each of four arms (the runner's p is then exact for every
    comparison but mt_grpo - grpo_merged's, drawn at random), one at the short (its arm's
    TOST and interaction are not made)."""
    design = tw.Design()
    args = argparse.Namespace(runs_dir=results.parent / "runs", results=results)
    rng = random.Random(11)
    gain = {"grpo": 0.0, "grpo_merged": 0.02, "mt_grpo": 0.06, "mt_grpo_unbiased": 0.07,
            "turn_rtg": 0.03, "gigpo": -0.3}
    # the configs read once (pure-Python YAML: 25 ms a read), written into the manifest at
    # the end (next_cell reads it at every step)
    parsed, configs = {}, []
    safe_load = tw.yaml.safe_load
    monkeypatch.setattr(tw.yaml, "safe_load", lambda text: copy.deepcopy(
        parsed[text] if text in parsed else parsed.setdefault(text, safe_load(text))))

    def record(cell, outcome, config, **extra):
        configs.append(config)
        tw.cf.record(results, {
            "cell": cell.id, "stage": cell.stage, "warm_start": cell.ws, "arm": cell.arm,
            "seed": cell.seed, "lr": cell.lr, "commit": "2d535c5" + "0" * 33, "dirty": False,
            "packages_sha256": "4650b9df" + "0" * 56, "horizon": cell.horizon,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra,
            "outcome": outcome, "seconds": 1.0})

    stopped_once = False
    while (cell := tw.next_cell(results, design)) is not None:
        if cell.stage == "warm-start":
            wins = WARM_START_WINS[cell.horizon][cell.ws]
            config = tw.tws.seed_config(cell.ws, args.runs_dir, tw.CONFIGS[cell.horizon])
            if wins is None:
                record(cell, "failed", config, error="synthetic")
                continue
            write_warm_start(results, cell.horizon, cell.ws, wins / 256)
            path = results / cell.id / "summary.json"
            summary = json.loads(path.read_text())
            summary["band"] = list(tw.BANDS[cell.horizon])
            summary["evaluation"].update(items=256, failed=0,
                                         success_ci95=list(tw.wilson(wins, 256)[1:]))
            path.write_text(json.dumps(summary))
            record(cell, "finished", config)
            continue
        ws_cell = tw.warm_start_of(results, cell)
        start = json.loads((results / ws_cell.id / "summary.json").read_text())
        config = tw.rl_config(args, design, cell, "model").model_dump(mode="json")
        extra = {"warm_start_cell": ws_cell.id, "warm_start_sha256": start["sha256"]}
        if cell.id in FAILED_RUNS:
            record(cell, "failed", config, error="synthetic", **extra)
            continue
        if not stopped_once:
            stopped_once = True
            record(cell, "stopped", config, **extra)
        level = start["evaluation"]["success"] + (0.25 if cell.horizon == "short" else 0.05)
        level += (gain[cell.arm] if cell.horizon == "long" else 0.0) + rng.gauss(0, 0.03)
        wins = min(256, max(0, round(256 * level)))
        (results / cell.id / "trainer").mkdir(parents=True, exist_ok=True)
        (results / cell.id / "trainer" / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "env/won": wins / 256 * i / 40}) + "\n" for i in range(1, 41)))
        (results / cell.id / "summary.json").write_text(json.dumps(
            {"after": {"textworld_cooking": {"success": wins / 256, "items": 256, "failed": 0}}}))
        record(cell, "finished", config, **extra)
    entries = tw.cf.read_manifest(results)
    (results / "manifest.jsonl").write_text("".join(
        json.dumps({**e, "config": config}) + "\n" for e, config in zip(entries, configs)))
    return design


def test_the_independent_check_agrees_with_the_report_and_finds_what_differs(tmp_path,
                                                                            monkeypatch):
    """``experiments/textworld_credit_check.py`` (numpy, scipy, statsmodels, in a venv of
    their own) on the report of a synthetic registered grid: every number agrees; a
    changed Holm p, and a cell gone from the grid, are found. Synthetic runs only: the
    study's own results are not read before its analysis point."""
    tw = load("textworld_credit")
    results = tmp_path / "results"
    design = registered_grid(tw, results, monkeypatch)
    assert design.registered
    monkeypatch.setattr(tw, "plot", lambda *args: None)  # no number in it
    report = tmp_path / "report.md"
    report.write_text(tw.report(argparse.Namespace(results=results, out=report), design))
    text = report.read_text()
    assert "Tests, primary: long, success" in text and "| mt_grpo - grpo | " in text

    def check(report, results=results):
        done = subprocess.run(
            [str(statcheck_python()), str(REPO / "experiments" / "textworld_credit_check.py"),
             "--report", str(report), "--results", str(results)],
            capture_output=True, text=True, timeout=300,
            # its modules compiled once, not at every start (uv installs no bytecode)
            env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
        return done.returncode, done.stdout + done.stderr

    rc, out = check(report)
    assert rc == 0, out
    assert "(all match)" in out and "DIFFERS" not in out
    # the short horizon's failed turn_rtg cell: no TOST or interaction for that arm
    assert "NOTE: equivalence, short, turn_rtg - grpo: not made" in out
    assert "NOTE: interaction, turn_rtg - grpo_merged: not made" in out

    # one Holm p of the primary family changed
    lines = text.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("Tests, primary: long, success")))
    row = next(i for i in range(at, len(lines)) if lines[i].startswith("| mt_grpo - grpo |"))
    cells = lines[row].split("|")
    holm = float(cells[4])
    cells[4] = f" {tw.cf.p_text(min(1.0, holm + 0.05) if holm < 0.9 else holm - 0.05)} "
    lines[row] = "|".join(cells)
    tampered = tmp_path / "tampered.md"
    tampered.write_text("\n".join(lines))
    rc, out = check(tampered)
    assert rc == 1, out
    differs = [x for x in out.splitlines() if x.startswith("DIFFERS")]
    assert len(differs) == 1 and "Tests, primary: long, success: mt_grpo - grpo Holm p" in \
        differs[0], out

    # a registered cell gone
    fewer = tmp_path / "fewer"
    shutil.copytree(results, fewer)
    shutil.rmtree(fewer / "confirmation" / "long" / "ws2" / "grpo-seed511")
    rc, out = check(report, fewer)
    assert rc == 1, out
    assert ("DIFFERS: confirmation/long/ws2/grpo-seed511: neither finished nor failed 3 "
            "times") in out
