"""The confirmatory study's runner (experiments/confirmatory.py): skip and resume, the
manifest, and the registered tests (experiments/stats.py) against hand-computed values
and independent brute-force computations written here."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from itertools import product
from math import factorial
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load(name):
    from conftest import load_script

    return load_script(f"experiments/{name}.py")


# --- statistics ---------------------------------------------------------------------------

def fisher_by_enumeration(a, b, c, d):
    """Every 2x2 table with the observed margins, its hypergeometric probability from
    factorials, summed over those no more likely than the observed one."""
    r1, r2, c1, c2 = a + b, c + d, a + c, b + d
    n = r1 + r2

    def p(x):
        y = [x, r1 - x, c1 - x, r2 - c1 + x]
        if min(y) < 0:
            return 0.0
        return (factorial(r1) * factorial(r2) * factorial(c1) * factorial(c2)
                / (factorial(n) * math.prod(factorial(v) for v in y)))

    observed = p(a)
    return sum(p(x) for x in range(r1 + 1) if 0 < p(x) <= observed * (1 + 1e-9))


def test_fisher_exact_against_hand_computed_tables_and_enumeration():
    stats = load("stats")
    # Fisher's tea-tasting table: (1 + 16 + 1 + 16) / 70 of the tables are as unlikely
    assert stats.fisher_exact(3, 1, 1, 3) == pytest.approx(34 / 70)
    assert stats.fisher_exact(0, 5, 5, 0) == pytest.approx(2 / 252)
    # 0 of 4 against 2 of 4: C(6,4)/C(8,4) = 15/70 at both tails
    assert stats.fisher_exact(0, 4, 2, 2) == pytest.approx(30 / 70)
    for table in [(2, 30, 13, 19), (0, 32, 12, 20), (5, 27, 5, 27), (1, 15, 7, 9), (4, 0, 0, 4)]:
        assert stats.fisher_exact(*table) == pytest.approx(fisher_by_enumeration(*table))


def test_mann_whitney_against_pairwise_counts():
    stats = load("stats")
    u, p = stats.mann_whitney([1, 2, 3], [4, 5, 6])
    assert u == 0 and p == pytest.approx(math.erfc((4.5 - 0.5) / math.sqrt(5.25) / math.sqrt(2)))
    x = [0.68, 0.05, 0.67, 0.0, 0.38, 0.0, 0.61, 0.66]
    y = [0.73, 0.66, 0.66, 0.66, 0.73, 0.27, 0.0, 0.7, 0.69]
    u_pairs = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in product(x, y))
    n1, n2 = len(x), len(y)
    n = n1 + n2
    tie_term = sum(t**3 - t for t in Counter(x + y).values())
    sigma = math.sqrt(n1 * n2 / 12 * (n + 1 - tie_term / (n * (n - 1))))
    z = (abs(u_pairs - n1 * n2 / 2) - 0.5) / sigma
    u, p = stats.mann_whitney(x, y)
    assert u == pytest.approx(u_pairs)
    assert p == pytest.approx(2 * (1 - 0.5 * (1 + math.erf(z / math.sqrt(2)))))
    assert stats.mann_whitney([0.5] * 4, [0.5] * 4) == (8.0, 1.0)


def test_holm_wilson_and_t_interval():
    stats = load("stats")
    assert stats.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx(
        {"a": 0.03, "c": 0.06, "b": 0.06})
    # 2 of 5: the Wilson interval's textbook value
    p, low, high = stats.wilson(2, 5)
    assert p == 0.4 and low == pytest.approx(0.1176, abs=1e-4)
    assert high == pytest.approx(0.7693, abs=1e-4)
    mean, low, high = stats.t_interval([0.0, 1.0, 2.0, 3.0, 4.0])  # s = sqrt(2.5), t4 = 2.776
    assert mean == 2.0 and high - mean == pytest.approx(2.776 * math.sqrt(2.5 / 5))


def test_primary_tests_on_hand_made_runs():
    cf = load("confirmatory")
    per_run = {}
    for seed, (tool, correct) in enumerate([(0.0, 0.05), (0.0, 0.0), (0.9, 0.6), (0.9, 0.7)]):
        per_run[("grpo", seed)] = {"tool_success": tool, "correct": correct}
        per_run[("mt_grpo", seed)] = {"tool_success": 0.9, "correct": 0.8 + seed / 100}
    tests = cf.primary_tests(per_run, ["grpo", "mt_grpo"])
    assert tests["collapse"]["p"]["mt_grpo"] == pytest.approx(30 / 70)  # 0/4 vs 2/4
    # U = 16 (every MT-GRPO run above every GRPO-OR run), sigma^2 = 16 * 9 / 12
    z = (16 - 8 - 0.5) / math.sqrt(12)
    assert tests["accuracy"]["p"]["mt_grpo"] == pytest.approx(math.erfc(z / math.sqrt(2)))
    assert tests["accuracy"]["holm"] == tests["accuracy"]["p"]  # one comparison


# --- the grid: skip, resume, manifest ----------------------------------------------------

def finish(runs_dir, arm, seed):
    (runs_dir / f"{arm}-seed{seed}").mkdir(parents=True)
    (runs_dir / f"{arm}-seed{seed}" / "summary.json").write_text("{}")


def test_pending_skips_finished_cells_and_cells_that_failed_three_times(tmp_path):
    cf = load("confirmatory")
    finish(tmp_path, "grpo", 0)
    finish(tmp_path, "mt_grpo", 0)
    (tmp_path / "turn_rtg-seed0").mkdir()  # an unfinished run: started again
    entries = ([{"arm": "gigpo", "seed": 0, "outcome": "failed"}] * 3
               + [{"arm": "turn_rtg", "seed": 0, "outcome": o} for o in ("failed", "stopped")])
    for entry in entries:
        cf.record(tmp_path, entry)
    assert cf.pending(tmp_path, list(cf.ARMS), [0, 1]) == [
        ("turn_rtg", 0), ("grpo", 1), ("mt_grpo", 1), ("gigpo", 1), ("turn_rtg", 1)]
    assert cf.pending(tmp_path, ["grpo", "mt_grpo"], [0]) == []
    assert list(cf.ARMS) == ["grpo", "mt_grpo", "gigpo", "turn_rtg"] and cf.SEEDS == list(range(32))


def fake_runs(outcomes):
    """A stand-in for ``run_quietly``: each call takes the next outcome, raises it if it
    is an exception, else writes the run's metrics and returns it as the summary."""
    outcomes = iter(outcomes)

    def run(config):
        outcome = next(outcomes)
        if isinstance(outcome, BaseException):
            raise outcome
        (config.run_dir / "trainer").mkdir(parents=True, exist_ok=True)
        (config.run_dir / "trainer" / "metrics.jsonl").write_text('{"step": 1}\n')
        return outcome

    return run


def test_run_cell_records_every_attempt_and_finishes_only_on_success(tmp_path, monkeypatch):
    """The run itself (vLLM, trainer, env server: minutes) is replaced by its outcomes:
    a summary, a RunFailed, a stop; the smoke run in the report runs it for real."""
    cf = load("confirmatory")
    results = tmp_path / "results"
    args = argparse.Namespace(config=REPO / "configs" / "credit_assignment.yaml",
                              runs_dir=tmp_path / "runs", results=results, steps=None,
                              lock=tmp_path / "lock")
    monkeypatch.setattr(cf, "run_quietly", fake_runs(
        [cf.RunFailed("trainer died"), KeyboardInterrupt(), {"seconds": 1.5}]))
    assert cf.run_cell(args, "model", "grpo", 5, evaluate_before=False) == "failed"
    with pytest.raises(KeyboardInterrupt):
        cf.run_cell(args, "model", "grpo", 5, evaluate_before=False)
    assert cf.pending(results, ["grpo"], [5]) == [("grpo", 5)]
    assert cf.run_cell(args, "model", "grpo", 5, evaluate_before=False) == "finished"
    assert cf.pending(results, ["grpo"], [5]) == []
    manifest = cf.read_manifest(results)
    assert [e["outcome"] for e in manifest] == ["failed", "stopped", "finished"]
    assert manifest[0]["error"] == "trainer died" and len(manifest[2]["commit"]) == 40
    assert {e["seed"] for e in manifest} == {5}
    config = manifest[2]["config"]
    assert config["train"]["estimator"] == "grpo" and config["train"]["seed"] == 5
    # what a fresh clone needs to skip the cell and report it: kept in the tracked results
    assert json.loads((results / "grpo-seed5" / "summary.json").read_text()) == {"seconds": 1.5}
    assert (results / "grpo-seed5" / "trainer" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert len(manifest[2]["warm_start_sha256"]) == 64


def test_every_registered_arm_is_a_valid_run(tmp_path):
    cf = load("confirmatory")
    args = argparse.Namespace(config=REPO / "configs" / "credit_assignment.yaml",
                              runs_dir=tmp_path, steps=None, arms=list(cf.ARMS))
    cf.check_arms(args)
    run = cf.ca.arm_config(args, "model", "gigpo", 7, arms=cf.ARMS)
    assert run.rl_train["estimator"] == "gigpo" and run.envs[0].settings["outcome_only"]
    assert run.envs[0].settings["seed"] == 1007


def test_an_invalid_arm_stops_the_grid_before_any_run(tmp_path, monkeypatch):
    cf = load("confirmatory")
    monkeypatch.setitem(cf.ARMS, "gigpo", ("GiGPO", {"estimator": "gigpo_typo"}, {}))
    args = argparse.Namespace(config=REPO / "configs" / "credit_assignment.yaml",
                              runs_dir=tmp_path, steps=None, arms=list(cf.ARMS))
    with pytest.raises(SystemExit, match=r"(?s)arm gigpo: .*gigpo_typo"):
        cf.check_arms(args)
    cf.check_arms(argparse.Namespace(**{**vars(args), "arms": ["grpo", "mt_grpo", "turn_rtg"]}))
    assert not list(tmp_path.iterdir())


def test_a_fresh_clone_starts_cells_from_the_studys_own_warm_start(tmp_path):
    """A cell repeated on a fresh clone starts from the weights every registered run
    started from (the manifest's hash), not from a warm start trained again."""
    cf = load("confirmatory")
    args = argparse.Namespace(config=REPO / "configs" / "credit_assignment.yaml",
                              runs_dir=tmp_path / "runs", steps=None)
    model = cf.study_warm_start(args)
    assert Path(model) == args.runs_dir / "warm-start" / "warm_start" / "final"
    assert not (args.runs_dir / "warm-start" / "warm_start" / "demonstrations.jsonl").exists()
    hashes = {e["warm_start_sha256"] for e in cf.read_manifest(cf.RESULTS)}
    assert hashes == {cf.weights_hash(model)}
