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
