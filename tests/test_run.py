"""``lachesis run``: the whole system as real processes (rollout API, vLLM CPU, env server,
trainer), a few steps long."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from lachesis.run.processes import processes_of_run

pytestmark = pytest.mark.vllm  # every run starts its own vLLM server

SHORT_RUN = {
    "warm_start": {"env": "arithmetic_tool", "demonstrations": 16,
                   "train": {"steps": 2, "batch_size": 8, "micro_batch_size": 8, "lr": 1.0e-3}},
    "vllm": {"max_model_len": 2048, "kv_cache_gib": 1},
    "api": {"max_staleness": 2},
    "envs": [{"name": "arithmetic_tool", "settings": {
        "group_size": 4, "max_turns": 2, "max_tokens_per_turn": 24, "max_queued_groups": 4,
        "eval_items": 4, "keep_equal_score_groups": True}}],
    "train": {"steps": 3, "batch_size": 8, "micro_batch_size": 8, "lr": 1.0e-4,
              "checkpoint_every": 10, "tensorboard": False},
}


def write_config(tmp_path: Path, model_dir: Path, name: str, **changes) -> Path:
    config = {"name": name, "runs_dir": str(tmp_path / "runs"), "model": str(model_dir),
              **SHORT_RUN, **changes}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_run(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lachesis.cli", "run", str(config), *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_id(run_dir: Path) -> str:
    return (run_dir / "run_id").read_text().strip()


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: "
                                 f"{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def test_short_run_flows_groups_syncs_weights_and_leaves_no_process(tiny_model_dir, tmp_path):
    # The quickstart's model: built by the run (learned tokenizer, compact tool prompt), so
    # vLLM serving it and the trainer's step-0 alignment check against vLLM are tested too.
    # One batch ahead at most (2 groups): step 3's groups start only after step 2's lease,
    # which follows step 1's weight sync, so they are sampled by a synced policy however
    # the processes are timed (4 ahead let steps 1-3 all train groups sampled at version 0).
    env = {**SHORT_RUN["envs"][0], "settings": {**SHORT_RUN["envs"][0]["settings"],
                                                "max_queued_groups": 2}}
    config = write_config(tmp_path, tiny_model_dir, "short", model=str(tmp_path / "arith"),
                          build_tiny_model={"tokenizer": "arithmetic"}, envs=[env])
    run = start_run(config)
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, err[-3000:]
    run_dir = tmp_path / "runs" / "short"
    assert processes_of_run(run_id(run_dir)) == []
    # every process started and logged
    logs = {p.stem for p in (run_dir / "logs").glob("*.log")}
    assert {"warm_start", "api", "vllm", "env-arithmetic_tool", "trainer",
            "eval-before-arithmetic_tool", "eval-after-arithmetic_tool"} <= logs
    # groups flowed env -> API -> trainer, written as trajectories
    groups = [json.loads(line) for line in
              (run_dir / "trajectories" / "arithmetic_tool.jsonl").read_text().splitlines()]
    assert len(groups) >= 6  # 3 steps x 2 groups of 4 per batch of 8
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["sync_seconds"] > 0 for m in metrics)  # weights went into vLLM every step
    assert "env/tool_success" in metrics[0]
    # policy versions advanced: later groups were sampled by synced policies
    versions = {v for g in groups for t in g["trajectories"]
                for v in (t.get("turn_policy_versions") or [])}
    assert max(versions) >= 1
    api_log = (run_dir / "logs" / "api.log").read_text()
    assert "Traceback" not in api_log
    # the summary: before/after table and the reward curve
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["before"]["arithmetic_tool"]) >= {"tool_success", "correct", "mean_outcome"}
    assert "| tool-call success |" in out
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "alignment check: mean |trainer - vLLM| logprob" in trainer_log
    assert (run_dir / "reward_curve.png").stat().st_size > 1000


def test_a_dead_env_server_is_restarted_then_the_run_stops_with_its_tail_and_resume_command(
        tiny_model_dir, tmp_path):
    """Also, while it trains: the run is guarded by its token (test_security.py)."""
    from test_security import check_the_run_is_guarded

    config = write_config(tmp_path, tiny_model_dir, "dies", warm_start=None, evaluate=False,
                          max_restarts=1, restart_backoff_s=0,
                          train={**SHORT_RUN["train"], "steps": 1000})
    run = start_run(config)
    run_dir = tmp_path / "runs" / "dies"
    metrics = run_dir / "trainer" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, 600, "a trainer step", run)
    rid = run_id(run_dir)
    check_the_run_is_guarded(run_dir, processes_of_run(rid))

    def env_server() -> list[int]:
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in processes_of_run(rid)}
        return [p for p, cmd in cmdlines.items()
                if b"env\0serve" in cmd and b"lachesis.run.guard" not in cmd]

    first = env_server()
    assert len(first) == 1
    os.kill(first[0], signal.SIGKILL)  # restarted: the run goes on
    wait_for(lambda: env_server() not in ([], first), 120, "the env server's restart", run)
    time.sleep(3)
    os.kill(env_server()[0], signal.SIGKILL)  # its restart is spent: the run stops
    out, err = run.communicate(timeout=120)
    assert run.returncode == 1
    assert "restarting it (1 of 1)" in out
    assert "env-arithmetic_tool was killed by SIGKILL" in err
    assert "(restarted 1 times already)" in err
    tail = err.split("last lines of", 1)[1]
    assert "env-arithmetic_tool.log" in tail and tail.count("env serve arithmetic_tool") == 1
    assert f"lachesis run {config} --resume" in err
    assert processes_of_run(rid) == []


def test_ctrl_c_during_startup_stops_everything(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, "interrupted", warm_start=None)
    run = start_run(config)
    run_dir = tmp_path / "runs" / "interrupted"
    vllm_log = run_dir / "logs" / "vllm.log"
    # interrupted as soon as vLLM's process is there, half started (still importing)
    wait_for(lambda: vllm_log.exists() and (run_dir / "run_id").exists()
             and len(processes_of_run(run_id(run_dir))) >= 2, 300, "vLLM to be starting", run)
    rid = run_id(run_dir)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 130, err[-2000:]
    assert "interrupted" in err
    assert processes_of_run(rid) == []


def test_bad_run_config_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, "bad",
                          train={"steps": 3, "learning_rate": 0.1})
    result = subprocess.run([sys.executable, "-m", "lachesis.cli", "run", str(config)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "train" in result.stderr and "learning_rate" in result.stderr
    assert not (tmp_path / "runs" / "bad").exists()
    wired = write_config(tmp_path, tiny_model_dir, "wired",
                         envs=[{"name": "arithmetic_tool", "settings": {"api_url": "http://x"}}])
    result = subprocess.run([sys.executable, "-m", "lachesis.cli", "run", str(wired)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "api_url" in result.stderr
    uneven = write_config(tmp_path, tiny_model_dir, "uneven", train={"batch_size": 10},
                          envs=[{"name": "arithmetic_tool", "settings": {"group_size": 4}}])
    result = subprocess.run([sys.executable, "-m", "lachesis.cli", "run", str(uneven)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "group_size 4 does not divide train.batch_size 10" in result.stderr


def test_killing_the_supervisor_outright_leaves_no_process(tiny_model_dir, tmp_path):
    """SIGKILL gives the supervisor no chance to clean up: the guards' parent-death signal
    takes every process group down, vLLM's engine core included."""
    config = write_config(tmp_path, tiny_model_dir, "killed", warm_start=None)
    run = start_run(config)
    run_dir = tmp_path / "runs" / "killed"
    vllm_log = run_dir / "logs" / "vllm.log"
    wait_for(lambda: vllm_log.exists() and b"EngineCore" in vllm_log.read_bytes(), 300,
             "vLLM's engine core to start", run)
    rid = run_id(run_dir)
    run.kill()
    run.communicate(timeout=30)
    wait_for(lambda: processes_of_run(rid) == [], 30, "the run's processes to go")


# 137 s, 90 s CPU beside the suite (7 Dec 2026): in `make test-all`. Still in `make test`:
# each adapter version served as the trainer has it and a replica without the adapter
# routed around (test_weight_sync.py's LoRA tests), a killed replica restarted and given
# the newest weights in a whole run (the whole-node test below).
@pytest.mark.slow
def test_lora_run_hot_loads_each_adapter_and_a_restarted_replica_gets_the_newest(
        tiny_model_dir, tmp_path):
    """`lora:` in the run config, two vLLM replicas: they start with runtime adapter
    loading, every step's adapter is loaded under a versioned name and the env's requests
    follow it. One replica is killed after step 1: the supervisor restarts it on the base
    model, the trainer leaves it behind and loads the newest adapter into it when it is
    back (requests that reach it before then are retried on the other replica), and every
    later sync reaches both."""
    steps = 3
    config = write_config(tmp_path, tiny_model_dir, "lora", warm_start=None, evaluate=False,
                          lora={"rank": 8, "alpha": 16},
                          vllm={**SHORT_RUN["vllm"], "replicas": 2},
                          train={**SHORT_RUN["train"], "steps": steps,
                                 "check_sync_every": True})
    run = start_run(config)
    run_dir = tmp_path / "runs" / "lora"
    try:
        kill_replica_until_it_is_back(run, run_dir)
        out, err = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["sync_check_mean_abs_diff"] < 1e-3 for m in metrics)
    assert metrics[0]["sync_checked_servers"] == 2 and metrics[-1]["sync_checked_servers"] == 2
    assert metrics[-1]["vllm_behind"] == 0
    assert sum(m["groups_set_aside"] for m in metrics) == 0
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "alignment check: mean |trainer - vLLM| logprob" in trainer_log
    assert " is back: loaded " in trainer_log and "/adapters/v" in trainer_log
    first, restarted = (run_dir / "logs" / "vllm-1.log").read_text().split("\n$ ")
    assert f"--model {tiny_model_dir} " in restarted  # the base model, LoRA flags kept
    assert "--enable-lora" in restarted
    assert "Loaded new LoRA adapter: name 'policy-lora-v000001'" in first
    assert f"Loaded new LoRA adapter: name 'policy-lora-v00000{steps}'" in restarted
    vllm_0 = (run_dir / "logs" / "vllm-0.log").read_text()
    assert all(f"Loaded new LoRA adapter: name 'policy-lora-v00000{v}'" in vllm_0
               for v in range(1, steps + 1))
    env_log = (run_dir / "logs" / "env-arithmetic_tool.log").read_text()
    assert "requests go to model policy-lora-v00000" in env_log
    assert sorted(p.name for p in (run_dir / "trainer" / "adapters").iterdir())[-1] == \
        f"v00000{steps}"


LETTER_E_ENV = """
from environments import BaseEnv, TurnLevelRewardMixin


class LetterEEnv(TurnLevelRewardMixin, BaseEnv):
    \"\"\"One turn, scored by its share of 'e' plus a little for length (varies per
    sample, so every step moves the weights).\"\"\"

    name = "letter_e"

    async def get_next_item(self):
        return {"id": "e", "question": "Write many e letters."}

    def prompt_messages(self, item):
        return [{"role": "user", "content": item["question"]}]

    def compute_turn_rewards(self, item, rollout):
        return [t.text.count("e") / max(1, len(t.text)) + 0.01 * len(t.text)
                for t in rollout.turns]

    def rollout_metrics(self, item, rollout, scores):
        return {"letter_e": 1.0}
"""


COLLAPSING_ENV = """
import asyncio

from environments import BaseEnv


class CollapsingEnv(BaseEnv):
    \"\"\"Its first 2 items score each sample by its share of 'e' (and length); every later
    item scores 0 for every sample, as a collapsed policy's groups do (and comes a little
    slowly: the dropped groups need not keep vLLM busy for the test to hold).\"\"\"

    name = "collapsing"
    drawn = 0

    async def get_next_item(self):
        self.drawn += 1
        if self.drawn > 2:
            await asyncio.sleep(0.5)
        return {"id": f"e{self.drawn}", "n": self.drawn, "question": "Write many e letters."}

    def prompt_messages(self, item):
        return [{"role": "user", "content": item["question"]}]

    def compute_reward(self, item, rollout):
        if item["n"] > 2:
            return 0.0
        text = rollout.final_text
        return text.count("e") / max(1, len(text)) + 0.01 * len(text)
"""


# 95 s, 56 s CPU beside the suite (7 Dec 2026): in `make test-all`. Still in `make test`:
# the trainer's early end as a normal one (test_trainer.py's max_batch_wait_s test) and a
# run's "after" evaluation and summary (the short run above).
@pytest.mark.slow
def test_a_run_whose_groups_all_score_equal_stops_training_early_and_still_evaluates(
        tiny_model_dir, tmp_path):
    """After step 1 every group scores equal and its env server drops it, so no batch
    comes again: ``max_batch_wait_s`` later the trainer ends with step 1's weights, and
    the run goes on as after a full one (env server stopped, "after" evaluation, summary)
    and says it stopped early. The "before" evaluation, during which the trainer already
    waits, does not count against the limit."""
    env_file = tmp_path / "collapsing.py"
    env_file.write_text(COLLAPSING_ENV)
    config = write_config(
        tmp_path, tiny_model_dir, "collapse", warm_start=None,
        envs=[{"name": f"{env_file}:CollapsingEnv", "settings": {
            "group_size": 4, "max_turns": 1, "max_tokens_per_turn": 16, "eval_items": 2,
            "keep_equal_score_groups": False,
            "concurrency": 4}}],  # (one group at a time: it samples groups it drops)
        train={**SHORT_RUN["train"], "steps": 3, "max_batch_wait_s": 8})
    run = start_run(config)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    run_dir = tmp_path / "runs" / "collapse"
    assert processes_of_run(run_id(run_dir)) == []
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [1]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["stopped_early"]
    assert (stopped["step"], stopped["steps"]) == (1, 3) and stopped["waited_s"] >= 8
    assert {"before", "after"} <= set(summary)
    assert (run_dir / "logs" / "eval-after-collapsing.py_CollapsingEnv.log").exists()
    said = f"training stopped early at step 1 of 3: no trainable batch for " \
           f"{stopped['waited_s']:.0f} s"
    assert said in out and said in (run_dir / "summary.md").read_text()
    assert "scored equal and was dropped there" in \
        (run_dir / "logs" / "trainer.log").read_text()
    assert (run_dir / "trainer" / "checkpoints" / "step_000001").is_dir()  # the end's


# 84 s, 62 s CPU beside the suite: a whole run for what the units check piece by piece:
# the API's weighted batches (test_batching.py's waiting deficit round robin, 3:1 within
# half a group), the env's pacing (test_api.py's max_queued_groups tests) and that the
# run paces every env (test_layout.py); two envs trained in one run is the whole-node test
@pytest.mark.slow
def test_two_envs_train_by_weight_and_neither_runs_more_than_a_batch_ahead(tiny_model_dir,
                                                                           tmp_path):
    """Weights 3 and 1, batches of 2 groups: after every step each env's trained groups are
    within half a group of its weight's share (the API's deficit round robin, which waits
    for the env the weights owe rather than filling with the other's queued groups; an
    even number of steps splits exactly), each step's mix in the metrics. The run paces
    both env servers (nothing in the config asks): at the end neither has pushed more
    than a batch beyond what was trained."""
    steps = 4
    env_file = tmp_path / "letter_e.py"
    env_file.write_text(LETTER_E_ENV + '\n\nclass LetterELight(LetterEEnv):\n'
                        '    name = "letter_e_light"\n')
    settings = {"group_size": 4, "max_turns": 1, "max_tokens_per_turn": 16}
    config = write_config(
        tmp_path, tiny_model_dir, "mix", warm_start=None, evaluate=False,
        envs=[{"name": f"{env_file}:LetterEEnv", "weight": 3, "settings": settings},
              {"name": f"{env_file}:LetterELight", "weight": 1, "settings": settings}],
        train={**SHORT_RUN["train"], "steps": steps})
    run = start_run(config)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    run_dir = tmp_path / "runs" / "mix"
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    assert [m["groups"] for m in metrics] == [2] * steps
    names = ("letter_e", "letter_e_light")
    trained = dict.fromkeys(names, 0)
    for k, m in enumerate(metrics, 1):
        for name in names:
            trained[name] += m.get(f"mix/{name}", 0)
        assert abs(trained["letter_e"] - 1.5 * k) <= 0.5, (k, trained)
    assert trained == {"letter_e": 3 * steps // 2, "letter_e_light": steps // 2}
    pushed = {name: len((run_dir / "trajectories" / f"letter_e.py_{cls}.jsonl")
                        .read_text().splitlines())
              for name, cls in zip(names, ("LetterEEnv", "LetterELight"))}
    # Groups the API dropped as too stale (max_staleness 2: the light env's second group
    # can wait 3 steps for its turn, the more so on a loaded machine) were pushed and not
    # trained, yet no further ahead: the env made another in their place.
    import sqlite3

    with sqlite3.connect(run_dir / "api" / "queue.sqlite") as db:
        env_names = {env_id: json.loads(record)["desired_name"]
                     for env_id, record in db.execute("SELECT env_id, record FROM envs")}
        dropped = dict.fromkeys(names, 0)
        for env_id, reason, n in db.execute(
                "SELECT env_id, drop_reason, count(*) FROM groups WHERE state = 'dropped' "
                "GROUP BY env_id, drop_reason"):
            assert reason == "stale", reason
            dropped[env_names[env_id]] += n
    # a batch holds 2 groups of 4: no env got further ahead (unpaced, envs push dozens)
    assert all(pushed[name] - trained[name] - dropped[name] <= 2 for name in names), \
        (pushed, trained, dropped)


def test_a_whole_node_on_cpu_survives_a_replica_killed_mid_run(tiny_model_dir, tmp_path):
    """The node layout on CPU: 2 vLLM replicas, a 2-process trainer (torchrun, gloo), two
    servers of a native env, and an OpenEnv server (openenv-core's create_app, in its own
    venv) that the run starts from a command, with its env. After every sync, each
    replica's logprobs of tokens it samples equal the trainer's (``check_sync_every``;
    training moves them by far more than the tolerance). One replica is killed after step
    1: the supervisor restarts it on the synced weights, the envs route around it, the
    trainer leaves it behind and loads the newest weights into it when it is back; later
    syncs check both replicas again, groups of both envs are trained, and the run
    finishes every step with no group lost.

    The trainer is held (SIGSTOP) from when it has noticed the dead replica until the
    replica is back, so that the run cannot end before then."""
    from third_party import openenv_python
    from transformers import AutoTokenizer

    steps = 5
    # A logit bias (vLLM's logprobs are from before it, unlike a grammar's) makes the
    # random model open tool calls and end turns: multi-turn OpenEnv episodes.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    bias = {str(tokenizer.convert_tokens_to_ids(t)): 5 for t in ("<tool_call>", "<|im_end|>")}
    env_file = tmp_path / "letter_e.py"
    env_file.write_text(LETTER_E_ENV)
    config = write_config(
        tmp_path, tiny_model_dir, "node", warm_start=None, evaluate=False,
        vllm={"replicas": 2, "max_model_len": 4096, "kv_cache_gib": 1},
        envs=[{"name": f"{env_file}:LetterEEnv", "count": 2, "weight": 2, "settings": {
            "group_size": 4, "max_turns": 1, "max_tokens_per_turn": 24,
            "max_queued_groups": 2}},
              {"name": "openenv:http://127.0.0.1:{port}", "weight": 0.5, "settings": {
                  "group_size": 4, "max_turns": 3, "max_token_length": 3000,
                  "max_queued_groups": 4, "keep_equal_score_groups": True,
                  "max_tokens_per_turn": 60, "sampling_extra": {"logit_bias": bias}},
               "server": {"command": [str(openenv_python()), "-m", "uvicorn",
                                      "openenv_guess_server:app", "--port", "{port}",
                                      "--app-dir", str(REPO / "tests" / "adapter_envs")],
                          "environment": {"GUESS_MAX_SESSIONS": "8"}}}],
        train={**SHORT_RUN["train"], "steps": steps, "nproc": 2, "lr": 1.0e-3,
               "weight_sync": "disk", "check_sync_every": True})
    run = start_run(config)
    run_dir = tmp_path / "runs" / "node"
    metrics_file = run_dir / "trainer" / "metrics.jsonl"
    try:
        kill_replica_until_it_is_back(run, run_dir)
        out, err = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-3000:]
    assert processes_of_run(run_id(run_dir)) == []
    metrics = [json.loads(line) for line in metrics_file.open()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["sync_check_mean_abs_diff"] < 1e-3 for m in metrics)
    # what the check would see on a replica left on the starting weights
    assert logprob_change(tiny_model_dir, max((run_dir / "trainer" / "weights").glob("v*"))) \
        > 1e-2
    checked = [m["sync_checked_servers"] for m in metrics]
    assert checked[0] == 2 and 1 in checked and checked[-1] == 2, checked
    assert metrics[-1]["vllm_behind"] == 0
    assert " is back: loaded " in (run_dir / "logs" / "trainer.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["vllm_restarts"] == {"vllm-1": 1}
    second = (run_dir / "logs" / "vllm-1.log").read_text().split("\n$ ")[1].split("\n")[0]
    # restarted on synced weights: a hard-linked copy of the newest version, which the
    # trainer cannot delete under the starting replica (lachesis/run/supervisor.py)
    assert "/trainer/restart/vllm-1" in second
    assert any((run_dir / "trainer" / "restart" / "vllm-1").glob("*.safetensors"))
    # groups of both envs were trained: their own metrics reached the trainer
    assert any("env/done" in m for m in metrics) and any("env/letter_e" in m for m in metrics)
    # no group lost: every group pushed was trained or is still queued, none set aside;
    # every env server contributed
    trained = sum(m["groups"] for m in metrics)
    pushed = [len(path.read_text().splitlines())
              for path in sorted((run_dir / "trajectories").glob("*.jsonl"))]
    assert len(pushed) == 3 and min(pushed) > 0 and sum(pushed) >= trained == steps * 2
    assert sum(m["groups_set_aside"] for m in metrics) == 0
    assert "Traceback" not in (run_dir / "logs" / "api.log").read_text()


def kill_replica_until_it_is_back(run: subprocess.Popen, run_dir: Path,
                                  trainer_log: str = "trainer.log") -> None:
    """Kill replica vllm-1 once the trainer has written step 1's metrics; hold the trainer
    (SIGSTOP) from when it has left the replica behind (says its rank 0's log,
    ``trainer_log``) until the supervisor's restart of it answers, so that the run cannot
    end before then."""
    metrics_file = run_dir / "trainer" / "metrics.jsonl"
    wait_for(lambda: metrics_file.exists() and metrics_file.read_text().count("\n") >= 1,
             600, "the first step", run)
    command = (run_dir / "logs" / "vllm-1.log").read_text().splitlines()[0]
    host, port = command.split("--host ")[1].split()[0], command.split("--port ")[1].split()[0]
    os.killpg(os.getpgid(replica_pid(run_id(run_dir), port)), signal.SIGKILL)
    wait_for(lambda: "when it answers again" in (run_dir / "logs" / trainer_log).read_text(),
             300, "the trainer to leave the dead replica behind", run)
    trainer = [pid for pid in processes_of_run(run_id(run_dir))
               if b"train" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    for pid in trainer:
        os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: (run_dir / "logs" / "vllm-1.log").read_text().count("\n$ ") == 1,
             60, "the restart", run)
    wait_for(lambda: healthy(f"http://{host}:{port}/health"), 600,
             "the restarted replica", run)
    for pid in trainer:
        os.kill(pid, signal.SIGCONT)


def logprob_change(before: Path, after: Path) -> float:
    """Mean |logprob| change of a random sequence's tokens between two models."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 250, (1, 32), generator=torch.Generator().manual_seed(0))
    logprobs = []
    for path in (before, after):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            all_logprobs = torch.log_softmax(model(ids).logits[0, :-1], -1)
        logprobs.append(all_logprobs.gather(-1, ids[0, 1:, None]))
    return float((logprobs[0] - logprobs[1]).abs().mean())


def healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def replica_pid(run: str, port: str) -> int:
    """The pid of the run's vLLM server on ``port``."""
    for pid in processes_of_run(run):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"environments.inference.vllm_serve" in cmdline and port.encode() in cmdline:
            return pid
    raise AssertionError(f"no vLLM process on port {port}")


# 63 s, 59 s CPU beside the suite: what the run starts for an atroposlib env and how
# (atropos-generate over the replicas, the env's settings and pacing) is test_layout.py's
# other-kinds test; that bridge, an unchanged env's own serve loop and lachesis train,
# wired as the run wires them, train aligned in test_atropos.py, as does a defaults env
# without logprobs
@pytest.mark.slow
def test_an_atropos_env_with_atroposlibs_defaults_runs_under_lachesis_run(tiny_model_dir,
                                                                         tmp_path):
    """An unchanged atroposlib env written with atroposlib's defaults (tests/test_atropos.py's:
    ``chat_completion``, ``tokenize_for_trainer``, the default ``collect_trajectories``, no
    ``inference_logprobs``) as an `envs:` entry: the run starts atropos-generate over its
    replica and the env's own serve loop once the trainer has registered; the trainer
    trains on every group it sends, none set aside."""
    import sqlite3

    from test_atropos import DEFAULTS_ATROPOS_ENV

    env_file = tmp_path / "letter_e_defaults.py"
    env_file.write_text(DEFAULTS_ATROPOS_ENV)
    config = write_config(
        tmp_path, tiny_model_dir, "atropos", warm_start=None, evaluate=False,
        envs=[{"name": f"{env_file}:LetterEDefaultsEnv",
               "settings": {"env": {"max_num_workers": 2}}}],
        train={**SHORT_RUN["train"], "steps": 2})
    run = start_run(config)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    run_dir = tmp_path / "runs" / "atropos"
    assert processes_of_run(run_id(run_dir)) == []
    assert {"atropos-generate", "env-letter_e_defaults.py_LetterEDefaultsEnv"} <= \
        {p.stem for p in (run_dir / "logs").glob("*.log")}
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    assert [m["groups"] for m in metrics] == [2, 2]
    assert all(m["groups_set_aside"] == 0 and m["sequences_without_behaviour_logprobs"] == 8
               for m in metrics)
    with sqlite3.connect(run_dir / "api" / "queue.sqlite") as db:
        envs = {json.loads(record)["desired_name"] for (record,) in
                db.execute("SELECT record FROM envs")}
        trained = db.execute("SELECT count(*) FROM groups WHERE state = 'done'").fetchone()[0]
    assert envs == {"letter_e_defaults"} and trained == 4
