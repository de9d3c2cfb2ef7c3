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
