"""The chaos benchmark's short version: one real ``lachesis run`` (API, vLLM CPU, env
server, trainer) during which, at seeded random moments, the trainer is killed with
SIGKILL and the env server, the rollout API and vLLM's engine core are frozen for good
with SIGSTOP (alive, answering nothing). What survives: each frozen process is named by
the run within its ``liveness.hang_timeout_s`` plus a check period (and a health check's
wait), killed and restarted; the run finishes, the metrics hold every step once, the
accounting adds up, "where the time went" adds up to the wall time, the final evaluation
runs. A freeze takes the path a kill takes once it is noticed (SIGKILL, restart), so the
kills of the env server and the API are not repeated here (benchmarks/chaos.py does
them). About 4-5 min wall on 2 cores, most of it vLLM's start and its restart."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO
from test_run import write_config

pytestmark = pytest.mark.vllm  # the run starts its own vLLM server


# 143 s, 80 s CPU beside the suite (7 Dec 2026): in `make test-all`. Its pieces stay in
# `make test`: a frozen process named, killed and restarted like a dead one
# (test_liveness.py), a trainer resumed from its checkpoint training the lost steps'
# groups again (test_resume.py), a dead env server restarted and a replica killed
# mid-run (test_run.py's dead-env-server and whole-node tests).
@pytest.mark.slow

def test_a_run_survives_its_trainer_killed_and_its_env_server_api_and_engine_frozen(
        tiny_model_dir, tmp_path):
    config = write_config(
        tmp_path, tiny_model_dir, "chaos", warm_start=None, evaluate_before=False,
        restart_backoff_s=0.2,
        liveness={"check_every_s": 1.0, "health_timeout_s": 2.0,
                  "hang_timeout_s": {"env": 8.0, "api": 8.0, "vllm": 15.0, "trainer": 60.0}},
        # 10 steps: faults planned at steps 2-8 leave room for a step or two of catching
        # up after a restart (queued groups train fast) before the run's last step
        train={"steps": 10, "batch_size": 8, "micro_batch_size": 8, "lr": 1.0e-4,
               "checkpoint_every": 2, "tensorboard": False})
    out = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", str(config), "--faults", "4", "--seed", "2",
         "--kinds", "trainer,freeze-env,freeze-api,freeze-engine", "--timeout-s", "300"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert "chaos: all checks passed" in out.stdout
    assert "killed trainer [" in out.stdout  # each fault struck a live process
    for target, named in (("env", "env-arithmetic_tool (env, this machine, pid "),
                          ("api", "api (api, http://127.0.0.1:"),
                          ("engine", "vllm (vllm, http://127.0.0.1:")):
        assert f"froze {target} [" in out.stdout
        assert named in out.stdout, (target, out.stdout[-4000:])
    assert "adds up: yes" in out.stdout
