"""The stress study (experiments/stress.py, docs/study-stress.md): its tests (stratified
permutation test, Student's t, TOST, Holm) against independent implementations written
here from the formulas, and the grid: order, the learning-rate rule, resume, the manifest.
No run starts here (the runs take minutes); the study's first cells ran for real."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import random
import statistics
from pathlib import Path

import pytest
from test_confirmatory import fake_runs

REPO = Path(__file__).resolve().parent.parent


def load(name):
    from conftest import load_script

    return load_script(f"experiments/{name}.py")


# --- independent implementations ------------------------------------------------------------

def permutation_p_by_enumeration(x, y):
    """Every relabelling of every stratum (which runs are called x), the statistic
    recomputed from the relabelled lists: mean over strata of mean(x) - mean(y)."""
    def stat(xs, ys):
        return statistics.mean(statistics.mean(a) - statistics.mean(b) for a, b in zip(xs, ys))

    observed = stat(x, y)
    choices = []
    for a, b in zip(x, y):
        pooled = a + b
        choices.append([([pooled[i] for i in idx],
                         [pooled[i] for i in range(len(pooled)) if i not in idx])
                        for idx in itertools.combinations(range(len(pooled)), len(a))])
    hits = total = 0
    for pick in itertools.product(*choices):
        total += 1
        hits += abs(stat([p[0] for p in pick], [p[1] for p in pick])) >= abs(observed) - 1e-12
    return observed, hits / total


def t_density(u, df):
    return (math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
            * (1 + u * u / df) ** (-(df + 1) / 2))


def t_sf_by_integration(t, df, pieces=20000):
    """P(T > t) = 1/2 - ∫_0^t density (Simpson's rule), for t >= 0."""
    h = t / pieces
    total = t_density(0, df) + t_density(t, df)
    total += sum((4 if i % 2 else 2) * t_density(i * h, df) for i in range(1, pieces))
    return 0.5 - total * h / 3


def holm_rejects(pvalues, alpha):
    """Holm's step-down procedure as stated: order the p-values, reject while
    p_(k) <= alpha / (m - k + 1), stop at the first that is not."""
    rejected = set()
    for k, (name, p) in enumerate(sorted(pvalues.items(), key=lambda kv: kv[1])):
        if p > alpha / (len(pvalues) - k):
            break
        rejected.add(name)
    return rejected


# --- the statistics ------------------------------------------------------------------------------

def test_stratified_permutation_test_against_enumeration_and_hand_values():
    stats = load("stats")
    # one stratum, 3 vs 3: 2 of the 20 relabellings are as extreme as the observed one
    assert stats.stratified_permutation([[1, 2, 3]], [[4, 5, 6]]) == (-3.0, pytest.approx(0.1))
    rng = random.Random(3)
    for sizes in [((3, 2), (2, 3)), ((3, 3), (2, 2), (1, 3))]:
        x = [[round(rng.random(), 2) for _ in range(a)] for a, _ in sizes]
        y = [[round(rng.random() + 0.3, 2) for _ in range(b)] for _, b in sizes]
        t, p = stats.stratified_permutation(x, y)
        t_ref, p_ref = permutation_p_by_enumeration(x, y)
        assert t == pytest.approx(t_ref) and p == pytest.approx(p_ref)
    # labels are exchanged within strata only: a difference between strata is no effect
    _, p = stats.stratified_permutation([[0.0, 0.1], [0.9, 1.0]], [[0.1, 0.0], [1.0, 0.9]])
    assert p == 1.0


def test_stratified_permutation_random_relabellings_agree_with_the_exact_p():
    stats = load("stats")
    rng = random.Random(5)
    x = [[rng.random() for _ in range(3)] for _ in range(3)]
    y = [[rng.random() + 0.25 for _ in range(3)] for _ in range(3)]
    _, exact = permutation_p_by_enumeration(x, y)  # 20^3 = 8000 relabellings
    _, sampled = stats.stratified_permutation(x, y, draws=4000, seed=1)
    assert abs(sampled - exact) < 4 * math.sqrt(exact * (1 - exact) / 4000) + 1 / 4000
    # the same seed, the same p (the registered analysis is repeatable)
    assert stats.stratified_permutation(x, y, draws=4000, seed=1)[1] == sampled
    with pytest.raises(ValueError, match="both arms"):
        stats.stratified_permutation([[1.0], []], [[1.0], [2.0]])


def test_student_t_tail_against_integration_and_the_table():
    stats = load("stats")
    for t, df in [(0.5, 3), (1.7, 7.5), (2.4, 30), (4.0, 2), (1.0, 61.3)]:
        assert stats.t_sf(t, df) == pytest.approx(t_sf_by_integration(t, df), abs=1e-9)
        assert stats.t_sf(-t, df) == pytest.approx(1 - t_sf_by_integration(t, df), abs=1e-9)
    for df, q in stats.T95.items():  # the printed table's 3 decimals
        assert stats.t_sf(q, df) == pytest.approx(0.025, abs=2e-4)
        assert stats.t_quantile(0.975, df) == pytest.approx(q, abs=1e-3)
    assert stats.t_sf(1.0, 1) == pytest.approx(0.25)  # Cauchy: 1/2 - atan(1)/pi


def test_tost_against_welch_from_the_formula():
    stats = load("stats")
    a = [0.61, 0.70, 0.55, 0.66, 0.72, 0.58]
    b = [0.64, 0.59, 0.69, 0.62, 0.57]
    # one stratum: Welch's two-sample statistics, written out
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    d = statistics.mean(a) - statistics.mean(b)
    margin = 0.1
    expected = max(t_sf_by_integration((d + margin) / se, df),
                   t_sf_by_integration((margin - d) / se, df))
    r = stats.tost([a], [b], margin)
    assert r["difference"] == pytest.approx(d) and r["se"] == pytest.approx(se)
    assert r["df"] == pytest.approx(df) and r["p"] == pytest.approx(expected, abs=1e-8)
    # two strata of equal weight: var(D) = (va1 + vb1 + va2 + vb2) / 4
    a2, b2 = [v + 0.2 for v in b], [v + 0.2 for v in a]
    r2 = stats.tost([a, a2], [b, b2], margin)
    parts = [statistics.variance(v) / len(v) / 4 for v in (a, b, a2, b2)]
    assert r2["difference"] == pytest.approx(
        (d + statistics.mean(a2) - statistics.mean(b2)) / 2)
    assert r2["se"] == pytest.approx(math.sqrt(sum(parts)))
    assert r2["df"] == pytest.approx(sum(parts) ** 2 / sum(
        v**2 / (len(s) - 1) for v, s in zip(parts, (a, b, a2, b2))))
    # equivalent at alpha exactly when the (1 - 2 alpha) interval is inside the margin
    rng = random.Random(2)
    for _ in range(40):
        x = [[rng.gauss(0.6, 0.1) for _ in range(8)] for _ in range(4)]
        y = [[rng.gauss(0.6 + rng.uniform(-0.08, 0.08), 0.1) for _ in range(8)] for _ in range(4)]
        r = stats.tost(x, y, 0.08)
        assert (r["p"] <= 0.05) == (-0.08 < r["low"] and r["high"] < 0.08)
    with pytest.raises(ValueError, match="at least 2"):
        stats.tost([[0.5]], [[0.5, 0.6]], 0.1)


def test_holm_against_the_step_down_procedure():
    stats = load("stats")
    rng = random.Random(7)
    for _ in range(200):
        pvalues = {name: rng.choice([rng.random() * 0.1, rng.random()]) for name in "abc"}
        adjusted = stats.holm(pvalues)
        for alpha in (0.01, 0.02, 0.05, 0.1):
            assert {k for k, p in adjusted.items() if p <= alpha} == holm_rejects(pvalues, alpha)


# --- the grid --------------------------------------------------------------------------------------

def write_summary(results, cell, correct=0.5, tool=0.9, steps=3, stalled_at=None):
    """``stalled_at``: the step its training stopped early at (max_batch_wait_s)."""
    folder = results / cell.id
    (folder / "trainer").mkdir(parents=True, exist_ok=True)
    (folder / "trainer" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "env/correct": correct, "env/tool_success": tool}) + "\n"
        for i in range(1, (stalled_at or steps) + 1)))
    after = {"tool_success": tool, "correct": correct, "exact_match": correct,
             "direct_answer": 0.0}
    summary = {"after": {"arithmetic_tool": after}}
    if stalled_at is not None:
        summary["stopped_early"] = {"step": stalled_at, "steps": steps, "waited_s": 600.2}
    (folder / "summary.json").write_text(json.dumps(summary))


def finish_warm_start(results, ws):
    folder = results / f"warm-starts/ws{ws}"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"sha256": "x" * 64}))


def test_the_registered_design():
    st = load("stress")
    design = st.Design()
    assert design.registered and design.arms == ("grpo", "mt_grpo", "gigpo", "turn_rtg")
    tuning = st.tuning_cells(design)
    confirmation = st.confirmation_cells(design, {arm: 3e-4 for arm in design.arms})
    assert len(tuning) == 48 and len(confirmation) == 128
    assert {c.lr for c in tuning} == {1e-4, 3e-4, 1e-3} and {c.ws for c in tuning} == {0}
    seeds = {c.seed for c in confirmation}
    assert len(seeds) == 32 and not seeds & {c.seed for c in tuning} and not seeds & set(range(32))
    for ws in (1, 2, 3, 4):  # 8 runs per arm and warm start, each arm on the same seeds
        per_arm = [{c.seed for c in confirmation if c.ws == ws and c.arm == arm}
                   for arm in design.arms]
        assert len(per_arm[0]) == 8 and all(s == per_arm[0] for s in per_arm)
    # the warm starts: seeds of their own, none the confirmatory study's (0 and 1)
    assert len({st.warm_start_seed(ws) for ws in range(5)} | {0, 1}) == 7
    # a study cut short stays balanced: the first 16 confirmation cells are run index 0
    assert {(c.ws, c.arm) for c in confirmation[:16]} == {
        (ws, arm) for ws in (1, 2, 3, 4) for arm in design.arms}


def test_the_grid_runs_in_order_and_the_rule_chooses_once(tmp_path):
    st = load("stress")
    design = st.Design(arms=("grpo", "mt_grpo"), lrs=(1e-4, 3e-4, 1e-3), tuning_seeds=(100, 101),
                       warm_starts=(1, 2), runs_per_warm_start=2)
    results = tmp_path
    assert st.next_cell(results, design) == st.warm_start_cell(0)
    finish_warm_start(results, 0)
    tuning = st.tuning_cells(design)
    assert st.next_cell(results, design) == tuning[0]
    # grpo: 1e-4 and 1e-3 tie on the mean (the smaller wins); mt_grpo: 1e-3 is best
    accuracy = {("grpo", 1e-4): [0.5, 0.7], ("grpo", 3e-4): [0.6, 0.55],
                ("grpo", 1e-3): [0.6, 0.6], ("mt_grpo", 1e-4): [0.5, 0.5],
                ("mt_grpo", 3e-4): [0.6, 0.6]}
    for cell in tuning[:-1]:  # mt_grpo at 1e-3, seed 101, not yet run
        assert st.next_cell(results, design) == cell
        values = accuracy.get((cell.arm, cell.lr), [0.7, 0.7])
        write_summary(results, cell, correct=values[design.tuning_seeds.index(cell.seed)])
    assert st.next_cell(results, design) == tuning[-1]
    assert not (results / "tuning-choice.json").exists()  # no choice before tuning settles
    for _ in range(st.MAX_ATTEMPTS):  # it fails every attempt: settled, missing
        st.cf.record(results, {"cell": tuning[-1].id, "outcome": "failed"})
    assert st.next_cell(results, design) == st.warm_start_cell(1)
    choice = json.loads((results / "tuning-choice.json").read_text())
    assert choice["chosen"] == {"grpo": 1e-4, "mt_grpo": 1e-3}
    assert choice["tuning"]["mt_grpo"]["0.001"] == {"runs": 1, "mean": 0.7}
    # written once: a tuning result changed afterwards does not move the choice
    write_summary(results, tuning[0], correct=0.0)
    finish_warm_start(results, 1)
    assert st.next_cell(results, design) == st.warm_start_cell(2)  # every warm start first
    assert st.read_choice(results)["chosen"] == {"grpo": 1e-4, "mt_grpo": 1e-3}
    # warm start 2 failed for good: its cells are left out, the others go on
    for _ in range(st.MAX_ATTEMPTS):
        st.cf.record(results, {"cell": "warm-starts/ws2", "outcome": "failed"})
    order = []
    while (cell := st.next_cell(results, design)) is not None:
        order.append((cell.ws, cell.arm, cell.seed, cell.lr))
        write_summary(results, cell)
    assert order == [(1, "grpo", 200, 1e-4), (1, "mt_grpo", 200, 1e-3),
                     (1, "grpo", 201, 1e-4), (1, "mt_grpo", 201, 1e-3)]
    assert st.progress(results, design) == ("warm starts 2/3, tuning 11/12, confirmation 4/8; "
                                            "6 attempts (6 failed, 0 stopped)")


def test_a_cell_attempt_records_its_identity_and_a_stopped_one_starts_again(tmp_path, monkeypatch):
    """The runs themselves (SFT, vLLM, trainer: minutes) are replaced by their outcomes;
    the study's first cells ran them for real."""
    st = load("stress")
    design = st.Design()
    results = tmp_path / "results"
    args = argparse.Namespace(config=REPO / "configs" / "credit_assignment.yaml",
                              runs_dir=tmp_path / "runs", results=results, steps=None,
                              sft_steps=None)

    def fake_sft(config):
        final = config.run_dir / "warm_start" / "final"
        final.mkdir(parents=True)
        (final / "model.safetensors").write_bytes(b"weights of " + config.name.encode())
        (final / "trainer_state.pt").write_bytes(b"optimizer")
        return {"final": str(final), "seconds": 2.0}

    monkeypatch.setattr(st, "train_warm_start", fake_sft)
    assert st.run_one(args, design, st.warm_start_cell(0)) == "finished"
    kept = results / "warm-starts" / "ws0"
    assert (kept / "model.safetensors").exists() and not (kept / "trainer_state.pt").exists()
    sft = st.cf.read_manifest(results)[0]["config"]["warm_start"]
    assert sft["settings"]["seed"] == 10 and sft["train"]["seed"] == 10

    monkeypatch.setattr(st, "run_quietly", fake_runs([KeyboardInterrupt(),
                                                      {"seconds": 3.0, "after": {}}]))
    cell = st.tuning_cells(design)[5]
    with pytest.raises(KeyboardInterrupt):
        st.run_one(args, design, cell)
    assert st.next_cell(results, design) == st.tuning_cells(design)[0]
    assert not st.is_finished(results, cell)  # a stopped run leaves no result
    assert st.run_one(args, design, cell) == "finished"
    manifest = st.cf.read_manifest(results)
    assert [e["outcome"] for e in manifest] == ["finished", "stopped", "finished"]
    entry = manifest[-1]
    assert entry["cell"] == cell.id and entry["lr"] == cell.lr and entry["warm_start"] == 0
    assert len(entry["commit"]) == 40 and entry["dirty"] in (True, False)
    assert entry["warm_start_sha256"] == json.loads((kept / "summary.json").read_text())["sha256"]
    assert entry["config"]["train"]["lr"] == cell.lr
    assert entry["config"]["train"]["max_batch_wait_s"] == st.MAX_BATCH_WAIT_S == 600
    assert entry["config"]["train"]["estimator"] == cell.arm
    assert entry["config"]["envs"][0]["settings"]["seed"] == 1000 + cell.seed
    listing = results / "packages" / f"{entry['packages_sha256']}.txt"
    assert "torch==" in listing.read_text()
    assert (results / cell.id / "trainer" / "metrics.jsonl").exists()
    # a warm start whose kept weights changed is refused, not run from
    (kept / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(SystemExit, match="not the recorded"):
        st.warm_start_model(argparse.Namespace(**{**vars(args), "runs_dir": tmp_path / "fresh"}), 0)


def test_every_registered_config_is_valid_and_a_smoke_design_keeps_out_of_the_results(
        tmp_path, monkeypatch, capsys):
    st = load("stress")
    args = argparse.Namespace(config=REPO / "configs" / "credit_assignment.yaml",
                              runs_dir=tmp_path, steps=None, sft_steps=None)
    st.check_design(args, st.Design())
    for cell in (st.tuning_cells(st.Design())[0],
                 st.confirmation_cells(st.Design(), {arm: 3e-4 for arm in st.ARMS})[-1]):
        train = st.rl_config(args, st.Design(), cell, "warm-start").train
        assert train["max_batch_wait_s"] == 600 and train["lr"] == cell.lr
    config = st.warm_start_config(args, 3)
    assert config.build_tiny_model["seed"] == 13 and config.warm_start.settings["seed"] == 13
    monkeypatch.setattr("sys.argv", ["stress.py", "--steps", "2", "--one"])
    with pytest.raises(SystemExit) as stopped:
        st.main()
    assert stopped.value.code == 2 and "add --results DIR" in capsys.readouterr().err


def test_registered_tests_and_report_on_hand_made_runs(tmp_path):
    st = load("stress")
    design = st.Design(arms=("grpo", "mt_grpo", "gigpo"), lrs=(3e-4,), tuning_seeds=(100,),
                       warm_starts=(1, 2), runs_per_warm_start=3)
    results = tmp_path
    finish_warm_start(results, 0)
    for cell in st.tuning_cells(design):
        write_summary(results, cell, stalled_at=2 if cell.arm == "gigpo" else None)
    st.next_cell(results, design)  # makes the choice
    rng = random.Random(0)
    for ws in (1, 2):
        finish_warm_start(results, ws)
    stalled = {("grpo", 200), ("mt_grpo", 209)}  # ws1 and ws2
    while (cell := st.next_cell(results, design)) is not None:
        base = 0.3 if cell.arm == "grpo" else 0.6
        tool = 0.1 if (cell.arm, cell.seed) == ("grpo", 200) else 0.9
        write_summary(results, cell, correct=base + cell.ws / 10 + rng.uniform(0, 0.05),
                      tool=tool, stalled_at=1 if (cell.arm, cell.seed) in stalled else None)
    values = st.confirmation_values(results, design)
    tests = st.registered_tests(values, list(design.arms))
    x, y = st.by_stratum(values, "mt_grpo", "grpo", "correct")
    assert tests["accuracy"]["p"]["mt_grpo"] == pytest.approx(permutation_p_by_enumeration(x, y)[1])
    p = tests["accuracy"]["p"]
    assert set(holm_rejects(p, 0.05)) == {a for a, q in tests["accuracy"]["holm"].items() if q <= 0.05}
    assert tests["collapse"]["difference"]["mt_grpo"] == pytest.approx(-1 / 3 / 2)
    assert set(tests["equivalence between the other arms"]) == {"mt_grpo - gigpo"}
    out = argparse.Namespace(results=results, out=tmp_path / "report.md")
    text = st.report(out, design)
    assert "| GRPO-OR (outcome only) | 0.0003 | 6 |" in text and "mt_grpo - grpo" in text
    # stalled runs: counted per arm and rate (tuning), per arm and warm start (confirmation)
    assert "| GiGPO (outcome only) | 1 of 1 | 1 of 1 |" in text
    assert "| GRPO-OR (outcome only) | 0 of 1 | 0 of 1 |" in text
    assert "| GRPO-OR (outcome only) | 1 of 3 | 0 of 3 | 1 of 6 |" in text
    assert "| MT-GRPO | 0 of 3 | 1 of 3 | 1 of 6 |" in text
    assert "Stalled: tuning/lr0.0003/gigpo-seed100 (step 2 of 3)." in text
    assert ("Stalled: confirmation/ws1/grpo-seed200 (step 1 of 3); "
            "confirmation/ws2/mt_grpo-seed209 (step 1 of 3).") in text
    # the sensitivity line: the primary test on the runs that did not stall
    kept = st.confirmation_values(results, design, without_stalled=True)
    assert sum(len(v) for a in kept.values() for v in a.values()) == 16
    again = st.registered_tests(kept, list(design.arms))["accuracy"]
    line = next(x for x in text.splitlines() if x.startswith("Sensitivity"))
    assert line.startswith("Sensitivity (not registered): the primary test without the 2 "
                           "stalled runs: MT-GRPO ")
    assert f"MT-GRPO {again['difference']['mt_grpo']:+.3f}, p " in line
    assert again["p"] != tests["accuracy"]["p"]
    assert (tmp_path / "report.png").stat().st_size > 0


def test_a_venv_that_drifted_is_pinned_back_to_the_recorded_package_list(tmp_path):
    """A fresh machine's `make install` resolves newer versions than a study's cells
    recorded: ``venv_pin.py`` puts the recorded ones back (a changed version, an added
    package) until the venv's list hashes to the recorded one, and refuses a list from
    another Python rather than half-pin it."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    uv = Path(sys.executable).parent / "uv"  # `make install` puts uv in the venv (2 s faster)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([str(uv), "venv", "-q", "--seed", "--python", base, str(venv)]
                   if uv.exists() else [sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"

    def pip(*specs):
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *specs],
                       check=True, timeout=300)

    def pin(*flags, listing):
        return subprocess.run([sys.executable, str(REPO / "experiments" / "venv_pin.py"),
                               "--python", str(python), *flags, str(listing)],
                              capture_output=True, text=True, timeout=300)

    pip("six==1.17.0")
    recorded = subprocess.run([str(python), str(REPO / "experiments" / "venv_pin.py"),
                               "--list"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(recorded.encode()).hexdigest()
    listing = tmp_path / "packages" / f"{digest}.txt"
    listing.parent.mkdir()
    listing.write_text(recorded)
    assert pin("--check", listing=listing).returncode == 0
    pip("six==1.16.0", "idna==3.10")  # the drift
    check = pin("--check", listing=listing)
    assert check.returncode == 1
    assert "differs: six==1.17.0 recorded" in check.stdout
    assert "differs: idna not in the list" in check.stdout
    done = pin(listing=listing)
    assert done.returncode == 0 and "is the recorded one" in done.stdout, done.stdout + done.stderr
    assert pin("--check", listing=listing).returncode == 0
    text = recorded.replace("# Python ", "# Python 2.7.0 was ", 1)
    other = tmp_path / "packages" / f"{hashlib.sha256(text.encode()).hexdigest()}.txt"
    other.write_text(text)
    refused = pin(listing=other)
    assert refused.returncode == 2 and "build the venv with that Python" in refused.stderr
