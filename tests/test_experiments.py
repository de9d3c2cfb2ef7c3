"""The credit-assignment experiment's configs: every arm of the CPU setting and of the GPU
one (which cannot run here: no GPU, no Hub) is a valid ``lachesis run`` config."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def experiment():
    from conftest import load_script

    return load_script("experiments/credit_assignment.py")


@pytest.mark.parametrize("config", ["credit_assignment.yaml", "credit_assignment_gpu.yaml"])
def test_every_arm_of_the_experiment_is_a_valid_run(config, tmp_path):
    ca = experiment()
    args = argparse.Namespace(config=REPO / "configs" / config, runs_dir=tmp_path, steps=None)
    base = ca.base_config(args)
    for arm, (_, settings) in ca.ARMS.items():
        run = ca.arm_config(args, base["model"], arm, seed=3)
        train = run.rl_train
        assert {k: train[k] for k in settings} == settings and train["seed"] == 3
        assert run.envs[0].settings["seed"] == 1003 and run.warm_start is None
        assert run.envs[0].settings["easy_fraction"] == 0.5
    if config == "credit_assignment_gpu.yaml":
        # a real instruct model, trained as a LoRA adapter in bfloat16
        assert run.model == "Qwen/Qwen2.5-1.5B-Instruct" and not run.build_tiny_model
        assert train["lora"]["rank"] == 32 and train["dtype"] == "bfloat16"
        assert run.vllm.dtype == "bfloat16"
    else:
        assert run.model == base["model"] == str(tmp_path / "tiny-model")


def test_the_wiki_pilots_second_pilot_cells_and_its_rates_over_items(tmp_path):
    """Study 4's second pilot (experiments/wiki_search_pilot.py --pilot 2): interleaved
    cells of 32 steps whose evaluations play every item 4 times; its rates are means over
    items with intervals over the item shares, and one sample per item keeps the Wilson
    rate over episodes of the first pilot."""
    import statistics

    from conftest import load_script
    from environments.framework.stats import ci95

    pilot = load_script("experiments/wiki_search_pilot.py")
    assert pilot.PILOT2[0] == "warm-start-rebuild/sft64"
    assert [c.rpartition("/")[2] for c in pilot.PILOT2[1:3]] == ["grpo-seed3", "mt_grpo-seed3"]
    first = pilot.rl_config(tmp_path, "m", "rl/one_hop/grpo-seed1", 6, 4e-5, False)
    second = pilot.rl_config(tmp_path, "m", "pilot2/one_hop/mt_grpo-seed4", 32, 4e-5, True,
                             eval_samples=4)
    second.check_sections()
    assert "eval_samples" not in first.envs[0].settings  # the first pilot's config as it was
    assert second.envs[0].settings["eval_samples"] == 4 and second.rl_train["steps"] == 32
    assert second.rl_train["estimator"] == "mt_grpo" and second.rl_train["seed"] == 4
    hits = {"a": [1, 1, 1, 1], "b": [1, 0, 0, 0], "c": [0, 0, 0, 0]}
    rows = [{"item_id": item, "metrics": {"exact_match": float(h)}, "turns": 2, "sampled": 9}
            for item, samples in hits.items() for h in samples]
    found = pilot.rates(rows)
    shares = [sum(s) / len(s) for s in hits.values()]
    half = 1.959963984540054 * statistics.stdev(shares) / len(shares) ** 0.5
    assert (found["episodes"], found["items"]) == (12, 3)
    assert found["exact_match"] == round(sum(shares) / 3, 4)
    assert found["exact_match_ci95"] == [round(max(0.0, sum(shares) / 3 - half), 4),
                                         round(min(1.0, sum(shares) / 3 + half), 4)]
    once = pilot.rates([r for i, r in enumerate(rows) if i % 4 == 1])  # one sample per item
    assert "items" not in once and once["exact_match"] == round(1 / 3, 4)
    assert once["exact_match_ci95"] == [round(x, 4) for x in ci95([1, 0, 0])]


def test_the_wiki_credit_studys_cell_order_tuning_rule_and_primary_test(tmp_path):
    """Study 4's runner (experiments/wiki_search_credit.py) on synthetic kept summaries:
    the order of its cells (the tuning warm start, every tuning cell until settled, the
    candidates until two are in band at both horizons, then the confirmation runs), the
    tuning rule (highest mean outcome, ties to the smaller rate, 4e-5 without a run, never
    recomputed), and the primary test and the sign-flip test against an exact enumeration
    written here."""
    import itertools
    import json

    from conftest import load_script

    wc = load_script("experiments/wiki_search_credit.py")
    results, design = tmp_path / "results", wc.Design()

    def keep(cell_id, summary):
        (results / cell_id).mkdir(parents=True, exist_ok=True)
        (results / cell_id / "summary.json").write_text(json.dumps(summary))

    def fail(cell_id, times):
        results.mkdir(parents=True, exist_ok=True)
        with open(results / "manifest.jsonl", "a") as f:
            for _ in range(times):
                f.write(json.dumps({"cell": cell_id, "outcome": "failed"}) + "\n")

    def warm_start(one_hop, two_hop):
        rates = {"one_hop": one_hop, "two_hop": two_hop}
        return {"sha256": "0" * 64, "in_band": all(0.3 <= r <= 0.9 for r in rates.values()),
                "evaluation": {h: {"tool_call_rate": r, "tool_call_rate_ci95": [r, r],
                                   "exact_match": 0.1} for h, r in rates.items()}}

    def next_id():
        cell = wc.next_cell(results, design)
        return cell and cell.id

    assert next_id() == "warm-starts/tuning"
    keep("warm-starts/tuning", warm_start(0.4, 0.47))
    assert next_id() == "tuning/one_hop/lr1e-05/grpo-seed900"
    # final mean outcome per horizon, arm and rate; None: that cell failed 3 times
    outcomes = {
        ("one_hop", "grpo"): [0.5, 0.7, 0.6],  # the highest: 4e-5
        ("one_hop", "grpo_merged"): [0.9, 0.2, 0.3],  # 1e-5
        ("one_hop", "mt_grpo"): [0.3, 0.8, 0.8 + 5e-13],  # a tie within 1e-12: 4e-5
        ("one_hop", "mt_grpo_unbiased"): [0.4, 0.4, 0.4],  # a three-way tie: 1e-5
        ("two_hop", "grpo"): [None, 0.1, 0.2],  # 1.6e-4
        ("two_hop", "grpo_merged"): [None, None, None],  # no finished run: 4e-5
        ("two_hop", "mt_grpo"): [0.2, 0.1, 0.2 + 1e-9],  # not a tie: 1.6e-4
        ("two_hop", "mt_grpo_unbiased"): [0.3, None, 0.1],  # 1e-5
    }
    expected = {"one_hop": {"grpo": 4e-5, "grpo_merged": 1e-5, "mt_grpo": 4e-5,
                            "mt_grpo_unbiased": 1e-5},
                "two_hop": {"grpo": 1.6e-4, "grpo_merged": 4e-5, "mt_grpo": 1.6e-4,
                            "mt_grpo_unbiased": 1e-5}}
    last_failed = "tuning/two_hop/lr0.00016/mt_grpo_unbiased-seed900"
    for (horizon, arm), values in outcomes.items():
        for lr, value in zip((1e-5, 4e-5, 1.6e-4), values):
            cell_id = f"tuning/{horizon}/lr{lr:g}/{arm}-seed900"
            if value is None:
                fail(cell_id, 3)
            elif cell_id != last_failed:
                keep(cell_id, {"after": {"wiki_search": {"mean_outcome": value}}})
    fail(last_failed, 2)  # two failures: not settled, it runs again
    assert next_id() == last_failed and not (results / "tuning-choice.json").exists()
    keep(last_failed, {"after": {"wiki_search": {"mean_outcome": 0.1}}})
    # the tuning stage is settled: the rule is applied, the first candidate is made
    assert next_id() == "warm-starts/seed11"
    choice = json.loads((results / "tuning-choice.json").read_text())
    assert choice["chosen"] == expected
    keep("tuning/one_hop/lr1e-05/grpo-seed900", {"after": {"wiki_search": {"mean_outcome": 9}}})
    assert wc.choose(results, design)["chosen"] == expected  # read, never recomputed
    keep("warm-starts/seed11", warm_start(0.4, 0.5))
    assert next_id() == "warm-starts/seed12"
    keep("warm-starts/seed12", warm_start(0.5, 0.95))  # out of band at two hops
    assert next_id() == "warm-starts/seed13"
    keep("warm-starts/seed13", warm_start(0.5, 0.6))
    first = wc.next_cell(results, design)
    assert first.id == "confirmation/one_hop/ws1/grpo-seed410" and first.lr == 4e-5
    order = wc.confirmation_cells(design, expected)
    assert len(order) == 48 and order[8].id == "confirmation/two_hop/ws1/grpo-seed410"
    assert order[16].id == "confirmation/one_hop/ws1/grpo-seed411"  # run index outermost
    assert order[9].lr == 4e-5 and order[10].lr == 1.6e-4  # two hops' chosen rates
    second = order[4]
    assert second.id == "confirmation/one_hop/ws2/grpo-seed420"
    assert wc.warm_start_of(results, second).id == "warm-starts/seed13"
    # confirmation runs at one hop, 2 per warm start, of GRPO-OR and MT-GRPO
    exact = {("mt_grpo", 1): [0.6, 0.5], ("grpo", 1): [0.3, 0.4],
             ("mt_grpo", 2): [0.45, 0.7], ("grpo", 2): [0.2, 0.5]}
    calls = {1: [0.2, 0.3], 2: [0.6, 0.1]}  # GRPO-OR's final tool-call rates
    for (arm, ws), values in exact.items():
        for i, value in enumerate(values):
            keep(f"confirmation/one_hop/ws{ws}/{arm}-seed{400 + 10 * ws + i}",
                 {"after_rates": {"exact_match": value, "tool_success": 0.5,
                                  "tool_call_rate": calls[ws][i] if arm == "grpo" else 0.9}})
    assert next_id() == "confirmation/one_hop/ws1/grpo_merged-seed410"
    tests = wc.registered_tests(wc.run_rows(results, design, expected))
    found = tests["primary"]["one_hop: mt_grpo - grpo, exact_match"]

    # by hand: every relabelling of 2 of each warm start's 4 runs as MT-GRPO's
    def stratum_differences(pooled):
        return [sum(pooled[j] for j in pick) / 2 -
                sum(pooled[j] for j in range(4) if j not in pick) / 2
                for pick in itertools.combinations(range(4), 2)]

    strata = [exact[("mt_grpo", ws)] + exact[("grpo", ws)] for ws in (1, 2)]
    observed = sum(sum(exact[("mt_grpo", ws)]) / 2 - sum(exact[("grpo", ws)]) / 2
                   for ws in (1, 2)) / 2
    relabelled = [(a + b) / 2 for a in stratum_differences(strata[0])
                  for b in stratum_differences(strata[1])]
    p = sum(abs(t) >= abs(observed) - 1e-12 for t in relabelled) / len(relabelled)
    assert len(relabelled) == 36 and p == pytest.approx(4 / 36)
    assert found["difference"] == pytest.approx(observed) == pytest.approx(0.2125)
    assert found["p"] == pytest.approx(p) and found["strata"] == 2
    assert found["holm"] == pytest.approx(2 * p)  # the other primary test here has p = 1
    assert tests["primary"]["one_hop: mt_grpo - grpo, tool_success"]["p"] == 1.0
    # GRPO-OR's final tool-call rate minus its warm start's (seed11: 0.4, seed13: 0.5)
    changes = [c - 0.4 for c in calls[1]] + [c - 0.5 for c in calls[2]]
    flips = [sum(s * c for s, c in zip(signs, changes)) / 4
             for signs in itertools.product((1, -1), repeat=4)]
    mean = sum(changes) / 4
    p = sum(t <= mean + 1e-12 for t in flips) / 16  # one-sided: below the warm start
    sign = tests["secondary (c): GRPO-OR stops invoking the tool (one-sided)"][
        "one_hop: grpo, final - warm start, tool_call_rate"]
    assert p == pytest.approx(3 / 16) and sign["p"] == pytest.approx(p)
    assert sign["difference"] == pytest.approx(mean) == pytest.approx(-0.15)
