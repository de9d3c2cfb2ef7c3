"""The chaos benchmark's short version: one real ``lachesis run`` (API, vLLM CPU, env
server, trainer) during which the trainer, the env server and the API are each killed
with SIGKILL at a seeded random moment. What survives: the run finishes, the metrics hold
every step once, the accounting adds up, the final evaluation runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO
from test_run import write_config

pytestmark = pytest.mark.vllm  # the run starts its own vLLM server


def test_a_run_survives_its_trainer_env_server_and_api_killed(tiny_model_dir, tmp_path):
    config = write_config(
        tmp_path, tiny_model_dir, "chaos", warm_start=None, evaluate_before=False,
        restart_backoff_s=0.2,
        # 10 steps: faults planned at steps 2-8 leave room for a step or two of catching
        # up after a restart (queued groups train fast) before the run's last step
        train={"steps": 10, "batch_size": 8, "micro_batch_size": 8, "lr": 1.0e-4,
               "checkpoint_every": 2, "tensorboard": False})
    out = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", str(config), "--faults", "3", "--seed", "3",
         "--kinds", "trainer,env,api", "--timeout-s", "300"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert "chaos: all checks passed" in out.stdout
    for kind in ("trainer", "env", "api"):
        assert f"killed {kind} [" in out.stdout  # each fault struck a live process
    assert "adds up: yes" in out.stdout
