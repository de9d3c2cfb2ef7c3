"""Study 3's runner (experiments/textworld_credit.py): the registered grid, the warm starts
chosen by their band, the learning-rate rule applied once, a cell's record, and the
registered tests against independent implementations. The runs themselves (SFT, vLLM,
the trainer: minutes each) are replaced by their outcomes; the study runs them for real."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics

import pytest
from test_confirmatory import fake_runs
from test_stress import REPO, holm_rejects, load, permutation_p_by_enumeration, t_sf_by_integration


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
