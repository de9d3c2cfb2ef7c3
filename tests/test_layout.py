"""The node layout of ``lachesis run`` (vLLM replicas, a torchrun trainer, env servers with
counts and weights, each process's devices) and ``lachesis run CONFIG --plan``, which
prints it and what cannot work without starting anything."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from lachesis.run.config import RunConfig
from lachesis.run.layout import (Placement, build_layout, trainer_processes,
                                  visible_devices)
from lachesis.run.plan import format_plan, make_plan
from lachesis.run.supervisor import Supervisor
from sandbox_fixtures import docker_image  # noqa: F401

ENV = {"group_size": 4, "max_token_length": 256}
NODE = {
    "name": "node", "model": "some/model",
    "vllm": {"replicas": 2, "tensor_parallel_size": 2, "devices": [0, 1, 2, 3]},
    "envs": [{"name": "arithmetic_tool", "count": 2, "weight": 3, "settings": ENV},
             {"name": "examples/reverse_word_env.py:ReverseWordEnv",
              "settings": {"group_size": 4}}],
    "train": {"nproc": 2, "devices": [4, 5], "batch_size": 8, "steps": 2},
}


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the env file path of NODE is relative


def config(tmp_path: Path, **changes) -> RunConfig:
    return RunConfig.model_validate({**NODE, "runs_dir": str(tmp_path / "runs"), **changes})


def test_vllm_settings_reach_each_replica_and_no_other_process(tmp_path):
    """``vllm.environment`` goes to every replica (over the run's own environment), not
    to the other processes; the access log is off unless ``vllm.access_log``."""
    vllm = {**NODE["vllm"], "environment": {"OMP_NUM_THREADS": "3", "VLLM_SOME_SETTING": "x"}}
    layout = build_layout(config(tmp_path, vllm=vllm))
    for replica in layout.replicas:
        assert replica.env["OMP_NUM_THREADS"] == "3" and replica.env["VLLM_SOME_SETTING"] == "x"
        assert "--disable-uvicorn-access-log" in replica.command
    others = [p for p in layout.processes if p not in layout.replicas]
    assert others and not any("VLLM_SOME_SETTING" in p.env for p in others)
    logged = build_layout(config(tmp_path, vllm={**vllm, "access_log": True}))
    assert not any("--disable-uvicorn-access-log" in r.command for r in logged.replicas)


def test_each_process_gets_its_devices_ports_and_the_replicas(tmp_path):
    run = config(tmp_path)
    run.check_sections()
    layout = build_layout(run)
    names = [p.name for p in layout.processes]
    assert names == ["api", "vllm-0", "vllm-1", "env-arithmetic_tool-0",
                     "env-arithmetic_tool-1", "env-reverse_word_env.py_ReverseWordEnv",
                     "trainer"]
    v0, v1 = layout.replicas
    assert (v0.devices, v1.devices) == ([0, 1], [2, 3])
    assert (v0.env["CUDA_VISIBLE_DEVICES"], v1.env["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")
    for replica in layout.replicas:
        at = replica.command.index("--tensor-parallel-size")
        assert replica.command[at + 1] == "2"
        assert replica.command[replica.command.index("--port") + 1] == str(replica.port)
    assert v0.port != v1.port and len({p.port for p in layout.processes if p.port}) == 3
    # every env server and the trainer know every replica
    urls = [v0.url, v1.url]
    for server in layout.envs:
        assert server.settings[1]["inference_servers"] == urls
    arith = [s.settings[1] for s in layout.envs if s.env_name == "arithmetic_tool"]
    assert [s["env_weight"] for s in arith] == [1.5, 1.5]  # weight 3 over 2 servers
    assert len({str(s["jsonl_out"]) for s in arith} | {str(s["spool_path"]) for s in arith}) == 4
    trainer = layout.trainer
    assert trainer.command[1:8] == ["-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node", "2", "-m", "lachesis.cli"]
    assert trainer.env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    train = trainer.settings[1]
    assert train["vllm_urls"] == urls and train["vllm_supervised"] is True
    assert "nproc" not in train and "devices" not in train  # not TrainConfig keys


def test_devices_are_indices_into_what_the_run_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert visible_devices([0, 3]) == "4,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_devices([0, 3]) == "0,3"


@pytest.mark.parametrize("changes,error", [
    ({"train": {"nproc": 2, "devices": [3, 4]}},
     "device 3 is given to vllm-1 and trainer rank 0: give each process its own devices, "
     "or list it in shared_devices"),
    ({"vllm": {"replicas": 2, "devices": [[0], [0]]}}, "device 0 is given to vllm-0 and vllm-1"),
    ({"train": {"nproc": 2, "devices": [4]}}, "train.devices: 1 devices for train.nproc 2"),
    ({"train": {"nproc": 0}}, "train.nproc: 0 is not a process count"),
    ({"vllm": {"replicas": 2, "tensor_parallel_size": 2, "devices": [0, 1, 2]}},
     "vllm.devices: 3 devices for 2 replica\\(s\\) of tensor_parallel_size 2: give 4"),
    ({"vllm": {"replicas": 2, "tensor_parallel_size": 2, "devices": [[0, 1], [2]]}},
     r"vllm.devices\[1\]: 1 devices for tensor_parallel_size 2"),
])
def test_a_layout_that_cannot_work_is_refused_naming_what_to_change(tmp_path, changes, error):
    with pytest.raises(ValueError, match=error):
        config(tmp_path, **changes).check_layout()


def test_a_deterministic_run_puts_its_env_in_lockstep_with_the_trainer_or_says_why_not(
        tmp_path):
    one_env = {"envs": [{"name": "arithmetic_tool", "settings": ENV}], "vllm": {},
               "train": {"batch_size": 8, "sync_every": 3, "steps": 2}}
    run = config(tmp_path, deterministic=True, **one_env)
    run.check_sections()
    (env,) = build_layout(run).envs
    # one trainer sync's groups: 3 steps of 8 sequences, groups of 4
    assert env.settings[1]["seeded_sampling"] is True
    assert env.settings[1]["groups_per_policy_version"] == 6
    layout = build_layout(run)
    assert layout.trainer.settings[1]["deterministic"] is True
    assert "--no-enable-chunked-prefill" in layout.replicas[0].command  # whole prefills
    assert "seeded_sampling" not in build_layout(config(tmp_path, **one_env)).envs[0].settings[1]
    refusals = [
        (config(tmp_path, deterministic=True), "deterministic: give one env server"),
        (config(tmp_path, deterministic=True, **{**one_env, "train": {
            "batch_size": 8, "dynamic_sampling": True}}),
         "deterministic: train.dynamic_sampling asks for groups beyond each batch"),
        (config(tmp_path, deterministic=True, **{**one_env, "envs": [{
            "name": "arithmetic_tool", "settings": {**ENV, "groups_per_policy_version": 4}}]}),
         r"groups_per_policy_version is 4, but deterministic sets it to 6; remove it"),
    ]
    for run, error in refusals:
        with pytest.raises(ValueError, match=error):
            run.check_sections()


def test_shared_devices_may_be_given_twice_on_purpose(tmp_path):
    run = config(tmp_path, train={"nproc": 2, "devices": [3, 4], "batch_size": 8},
                 shared_devices=[3])
    run.check_layout()
    assert build_layout(run).trainer.env["CUDA_VISIBLE_DEVICES"] == "3,4"


def test_plan_finds_every_problem_and_starts_nothing(tmp_path, tiny_model_dir, capsys):
    """Devices this machine lacks, group sizes that do not divide the batch (each env), an
    env that cannot be found, a tokenizer larger than the model's vocabulary, a tokenizer
    without a chat template. (`lachesis run --plan` in this process: a process of its own
    cost 9 s of CPU for its imports, 45 s beside the suite; a run's start refused on the
    plan is test_run_refuses_to_start_on_what_the_plan_flags's.)"""
    from lachesis.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    settings = json.loads((model / "config.json").read_text())
    settings["vocab_size"] = 100
    (model / "config.json").write_text(json.dumps(settings))
    for path in [model / "chat_template.jinja", model / "tokenizer_config.json"]:
        if path.name == "tokenizer_config.json":
            values = json.loads(path.read_text())
            values.pop("chat_template", None)
            path.write_text(json.dumps(values))
        else:
            path.unlink(missing_ok=True)
    bad = {**NODE, "name": "bad", "runs_dir": str(tmp_path / "runs"), "model": str(model),
           "envs": [{"name": "arithmetic_tool", "settings": {"group_size": 3}},
                    {"name": "examples/reverse_word_env.py:ReverseWordEnv",
                     "settings": {"group_size": 5}}]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    code = main(["run", str(path), "--plan"])
    out, err = capsys.readouterr()
    assert code == 1, err[-2000:]
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written
    for expected in [
            "vllm-0: device(s) [0, 1] asked for, but this machine has 0 GPU(s)",
            "trainer: device(s) [4, 5] asked for",
            "group_size 3 does not divide train.batch_size 8",
            "group_size 5 does not divide train.batch_size 8",
            "the tokenizer has", "but the model's vocabulary 100",
            "has no chat template",
            "$ " + sys.executable + " -m torch.distributed.run --standalone --nproc-per-node 2",
            "log: " + str(tmp_path / "runs" / "bad" / "logs" / "vllm-1.log"),
            "CUDA_VISIBLE_DEVICES=2,3"]:
        assert expected in out, f"{expected!r} not in:\n{out}"

    missing = {**bad, "envs": [{"name": "no_such_env"}]}
    path.write_text(yaml.safe_dump(missing))
    plan = make_plan(RunConfig.load(path, check=False), devices_present=8)
    text = format_plan(plan)
    assert "unknown environment 'no_such_env'" in text and "problems (" in text


def test_the_8_gpu_node_config_plans_cleanly_on_8_gpus():
    """configs/node_8gpu.yaml (docs/node-layout.md): no problem but the model, which is not
    on this machine, given 8 devices; all 8 are placed, none twice."""
    run = RunConfig.load(REPO / "configs" / "node_8gpu.yaml", check=False)
    plan = make_plan(run, devices_present=8)
    assert plan.problems == []
    placed = [d for p in plan.layout.processes for d in p.devices or []]
    assert sorted(placed) == list(range(8))
    assert [p.problems for p in [make_plan(run, devices_present=4)]][0] == [
        "trainer: device(s) [4, 5, 6, 7] asked for, but this machine has 4 GPU(s) "
        "(CUDA_VISIBLE_DEVICES counts)"]


ATROPOS_ENV = '''
from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig


class TinyAtroposEnv(BaseEnv):
    name = "tiny_atropos"

    @classmethod
    def config_init(cls):
        return (BaseEnvConfig(group_size=4, max_token_length=256, use_wandb=False),
                [APIServerConfig(model_name="tiny", api_key="x")])
'''


def test_other_kinds_of_env_in_a_run_an_openenv_server_an_atropos_env_another_python(
        tmp_path):
    """An OpenEnv server the run starts itself (``{port}``), an atroposlib env (its own
    serve loop through atropos-generate, its settings in its own YAML shape), and an env
    whose processes run in another interpreter, checked by that interpreter."""
    atropos_file = tmp_path / "tiny_atropos.py"
    atropos_file.write_text(ATROPOS_ENV)
    run = config(tmp_path, vllm={"replicas": 2}, train={"batch_size": 8}, envs=[
        {"name": "openenv:http://127.0.0.1:{port}", "settings": {"group_size": 4},
         "server": {"command": ["python", "-m", "uvicorn", "server:app", "--port", "{port}"],
                    "environment": {"URL": "http://127.0.0.1:{port}/x"}}},
        {"name": f"{atropos_file}:TinyAtroposEnv", "count": 2, "weight": 2,
         "settings": {"env": {"max_num_workers": 2}, "openai": {"api_key": "y"}}},
        {"name": "reverse_word_env:ReverseWordEnv", "python": sys.executable,
         "environment": {"PYTHONPATH": str(REPO / "examples")},
         "settings": {"group_size": 2}}])
    run.check_sections()
    text = format_plan(make_plan(run, devices_present=0))
    assert "problems: none found" in text and "(atroposlib env): group size 4" in text
    layout = build_layout(run)
    [server] = layout.backends
    port = server.port
    assert server.command == ["python", "-m", "uvicorn", "server:app", "--port", str(port)]
    assert server.env == {"URL": f"http://127.0.0.1:{port}/x"}
    assert server.health_url == f"http://127.0.0.1:{port}/health"
    openenv, atropos0, atropos1, other = layout.envs
    assert openenv.env_name == f"openenv:http://127.0.0.1:{port}"
    assert (openenv.kind, atropos0.kind, other.kind) == ("lachesis", "atropos", "lachesis")
    bridge = layout.bridge
    assert bridge.command[3:] == ["atropos-generate", "--vllm-url", layout.replicas[0].url,
                                  "--vllm-url", layout.replicas[1].url, "--model", "policy",
                                  "--host", "127.0.0.1", "--port", str(bridge.port)]
    settings = atropos1.settings[1]
    # the server's port is picked per start: the env's name and files must not follow it
    assert openenv.settings[1]["env_name"] == openenv.label == "openenv_http_127.0.0.1"
    assert "env_name" not in other.settings[1]
    # every env is paced by the run: at most a batch of its groups ahead of the trainer
    assert [e.settings[1]["max_queued_groups"] for e in (openenv, other)] == [2, 4]
    assert layout.api.settings[1]["status_env_own_queue"]  # atroposlib envs: their own
    assert settings["env"] == {"max_batches_offpolicy": 1, "max_num_workers": 2,
                               "rollout_server_url": layout.api.url,
                               "tokenizer_name": "some/model", "use_wandb": False,
                               "inference_weight": 1.0}
    assert settings["openai"]["base_url"] == f"{bridge.url}/v1"
    assert settings["openai"]["api_key"] == "y"
    assert other.command[0] == sys.executable
    assert other.env["PYTHONPATH"] == os.pathsep.join([str(REPO / "examples"), str(REPO)])

    # what is wrong with each is said before anything starts
    for env, error in [
            ({"name": f"{atropos_file}:TinyAtroposEnv", "settings": {"group_size": 4}},
             "an atroposlib env's settings are `env:` and `openai:`"),
            ({"name": f"{atropos_file}:TinyAtroposEnv",
              "settings": {"env": {"rollout_server_url": "x"}}},
             "env: rollout_server_url are set by `lachesis run`"),
            ({"name": "reverse_word_env:ReverseWordEnv", "python": sys.executable,
              "environment": {"PYTHONPATH": str(REPO / "examples")},
              "settings": {"group_size": "many"}}, "checked with"),
            ({"name": "openenv:http://127.0.0.1:{port}", "server": {}},
             "give the server's command or its docker_image")]:
        with pytest.raises(ValueError, match=error):
            config(tmp_path, train={"batch_size": 8}, envs=[env]).check_sections()


def test_the_plan_says_what_listens_where_and_what_guards_it(tmp_path):
    """On a cluster (a placement that answers with a node's address; nothing connects to
    it) the API and vLLM listen on their node's address, guarded by the run's token; an
    OpenEnv server, which has no authentication, listens on loopback, placed beside its
    env's servers. A token in the run config is refused (it would land in the settings
    files)."""
    from lachesis.run.layout import Placement
    from lachesis.run.plan import listening_lines

    class Cluster(Placement):
        per_rank = True

        def host(self, name):
            return "10.9.9.9"

        def port(self, name, port=None):
            return port or 30000 + len(name)

        def local_port(self, name):
            return 40000

        def server_place(self, label):
            return f"env-{label}"

        def rank_env(self, rank, world):
            return {"LOCAL_RANK": "0"}

    run = config(tmp_path, vllm={"replicas": 1}, train={"batch_size": 8, "nproc": 2}, envs=[
        {"name": "openenv:http://{host}:{port}", "count": 2, "settings": {"group_size": 4},
         "server": {"command": ["serve", "--host", "{host}", "--port", "{port}"]}}])
    layout = build_layout(run, place=Cluster())
    [server] = layout.backends
    assert server.command == ["serve", "--host", "127.0.0.1", "--port", "40000"]
    assert {e.where for e in layout.envs} == {server.where} and server.where.startswith("env-")
    assert {e.env_name for e in layout.envs} == {"openenv:http://127.0.0.1:40000"}
    lines = "\n".join(listening_lines(layout))
    assert f"api: {layout.api.url} (reachable at 10.9.9.9); guarded" in lines
    assert "vllm: http://10.9.9.9:30004 (reachable at 10.9.9.9); guarded" in lines
    assert (f"{server.name}: http://127.0.0.1:40000 (loopback only); not guarded (no "
            f"authentication of its own), runs beside {server.where}") in lines
    assert "trainer ranks: rendezvous (torch's TCP store) at 10.9.9.9:" in lines
    assert "--middleware" in layout.replicas[0].command

    tokens = config(tmp_path, api={"token": "x"}, train={"batch_size": 8, "api_token": "x"})
    problems = make_plan(tokens, devices_present=8).problems
    assert [p.split(":")[0] for p in problems if "LACHESIS_API_TOKEN" in p] == [
        "api.token", "train.api_token"]


HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "healthy"}')
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def containers(name: str) -> list[str]:
    return subprocess.run(["docker", "ps", "--all", "--quiet", "--filter", f"name={name}"],
                          capture_output=True, text=True, check=True).stdout.split()


def test_a_server_from_a_docker_image_is_waited_for_and_gone_when_the_run_stops(
        tmp_path, docker_image):
    """The server an OpenEnv env talks to, from an image: the supervisor starts the
    container, waits for its health on the host's network, and nothing of it is left after
    the run stops (a python server as PID 1 would ignore docker's SIGTERM; --init)."""
    run = config(tmp_path, train={"batch_size": 8}, envs=[
        {"name": "openenv:http://127.0.0.1:{port}", "settings": {"group_size": 4},
         "server": {"docker_image": docker_image,
                    "command": ["python3", "-c", HEALTH_SERVER, "{port}"]}}])
    supervisor = Supervisor(run)
    supervisor.layout = layout = build_layout(run)
    [backend] = layout.backends
    child = supervisor.start_process(backend)
    try:
        supervisor.wait_healthy(child, backend.health_url, timeout_s=60)
        assert len(containers(backend.container)) == 1
    finally:
        supervisor.stop_all()
    assert child.returncode not in (None, -9), "the container did not stop on SIGTERM"
    assert containers(backend.container) == []
    assert "docker run --rm --init --network host" in child.log_path.read_text()


def test_an_atropos_env_runs_its_own_cli_under_lachesis_env(tmp_path):
    atropos_file = tmp_path / "tiny_atropos.py"
    atropos_file.write_text(ATROPOS_ENV)
    done = subprocess.run([sys.executable, "-m", "lachesis.cli", "env", "serve",
                           f"{atropos_file}:TinyAtroposEnv", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--env.rollout_server_url" in done.stdout and "--openai.base_url" in done.stdout


def test_run_refuses_to_start_on_what_the_plan_flags(tmp_path):
    bad = {**NODE, "name": "nogpu", "runs_dir": str(tmp_path / "runs"),
           "vllm": {"replicas": 1, "devices": [99]}, "train": {"batch_size": 8},
           "envs": [{"name": "arithmetic_tool", "settings": ENV}]}
    path = tmp_path / "nogpu.yaml"
    path.write_text(yaml.safe_dump(bad))
    done = subprocess.run([sys.executable, "-m", "lachesis.cli", "run", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "vllm: device(s) [99] asked for, but this machine has" in done.stderr
    assert not (tmp_path / "runs" / "nogpu" / "logs").exists()  # nothing started


def test_ports_handed_out_are_below_the_ephemeral_range_and_never_twice():
    """A run picks its processes' ports before they bind them; picked from the ephemeral
    range (a port-0 bind), one could be taken in between by any outgoing connection on
    the machine (a torchrun rendezvous failed so, EADDRINUSE, in a suite run)."""
    from environments.inference.vllm_process import free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(20000 <= port < 32768 for port in ports)


def test_plan_warns_of_constrained_sampling(tmp_path):
    """Structured outputs make vLLM's logprobs those of the constrained distribution:
    --plan says so (the run still starts; the step-0 alignment check names the cause)."""
    regex = {"structured_outputs": {"regex": "[0-9]+"}}
    run = config(tmp_path, envs=[{"name": "arithmetic_tool",
                                  "settings": {**ENV, "sampling_extra": regex}}])
    plan = make_plan(run, devices_present=8)
    assert plan.warnings == [
        "envs[0] (arithmetic_tool): sampling_extra.structured_outputs constrains sampling; "
        "vLLM's logprobs are then of the constrained distribution, not the policy's, so the "
        "trainer's step-0 alignment check will fail (tokens, masks or the model do not line "
        "up) and its importance ratios are off: sample without it"]
    assert f"warning: {plan.warnings[0]}" in format_plan(plan)
    assert make_plan(config(tmp_path), devices_present=8).warnings == []


def test_a_dead_openenv_server_is_restarted_on_its_address_until_its_restarts_are_spent(
        tmp_path):
    """What a dying server the run started sees: restarted on the same address (bounded,
    with backoff), then the run stops with that start's log tail and the command that
    continues the run."""
    from lachesis.run.supervisor import RunFailed

    run = config(tmp_path, train={"batch_size": 8}, max_restarts=1, restart_backoff_s=0.1,
                 envs=[{"name": "openenv:http://127.0.0.1:{port}", "settings": {"group_size": 4},
                        "server": {"command": ["python3", "-c", HEALTH_SERVER, "{port}"]}}])
    supervisor = Supervisor(run)
    supervisor.resume_command = "lachesis run run.yaml --resume"
    supervisor.layout = layout = build_layout(run)
    [backend] = layout.backends
    child = supervisor.start_process(backend)
    supervisor.restartable = {backend.name: run.max_restarts}
    try:
        supervisor.wait_healthy(child, backend.health_url, timeout_s=60)
        first = child.proc.pid
        guard = Path(f"/proc/{first}/task/{first}/children")
        os.kill(int(guard.read_text().split()[0]), signal.SIGKILL)  # the server itself
        child.proc.wait()
        supervisor.check_alive()  # restarted, on the same port
        assert child.proc.pid != first and supervisor.restarts == {backend.name: 1}
        supervisor.wait_healthy(child, backend.health_url, timeout_s=60)
        child.proc.kill()
        child.proc.wait()
        with pytest.raises(RunFailed) as failed:
            supervisor.check_alive()
    finally:
        supervisor.stop_all()
    message = str(failed.value)
    assert f"{backend.name} was killed by SIGKILL" in message
    assert "(restarted 1 times already)" in message
    assert message.count("$ ") == 1  # this start's tail, not the first start's
    assert message.endswith("to continue the run from its last checkpoint: "
                            "lachesis run run.yaml --resume")


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A memory cgroup of its own (v1 or v2) holding at most ``limit_bytes``: yields its
    ``cgroup.procs``. Skips where none can be made (no root, no writable cgroup fs)."""
    v1 = Path("/sys/fs/cgroup/memory")
    root, limit = ((v1, "memory.limit_in_bytes") if (v1 / "memory.limit_in_bytes").exists()
                   else (Path("/sys/fs/cgroup"), "memory.max"))
    group = root / f"lachesis-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / limit).write_text(str(limit_bytes))
    except OSError as error:
        with contextlib.suppress(OSError):
            group.rmdir()
        pytest.skip(f"no memory cgroup can be made here ({error})")
    try:
        yield group / "cgroup.procs"
    finally:
        for _ in range(50):  # a killed process leaves its cgroup when it has been reaped
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)


def test_a_trainer_the_oom_killer_killed_is_named_with_what_needs_less_memory(tmp_path,
                                                                              capsys):
    """A trainer killed by the kernel's out-of-memory killer (a real one: the process
    allocates past its memory cgroup's limit) is not just "exited with code -9": the
    supervisor says the OOM killer killed a process while it ran, and which settings make
    the trainer need less memory (its restart replays the same batches), at its restart
    and when the run stops."""
    from lachesis.run.supervisor import RunFailed

    run = config(tmp_path, train={"batch_size": 8, "max_tokens_per_micro_batch": 4096},
                 max_restarts=1, restart_backoff_s=0.1)
    supervisor = Supervisor(run)
    supervisor.restartable = {"trainer": 1}
    with memory_cgroup(64 << 20) as procs:
        child = supervisor.start("trainer", [
            "sh", "-c", f"echo $$ > {procs} && exec {sys.executable} -c 'bytearray(1 << 30)'"])
        try:
            child.proc.wait(60)
            supervisor.check_alive()  # restarted
            restarted = capsys.readouterr().out
            child.proc.wait(60)
            with pytest.raises(RunFailed) as failed:
                supervisor.check_alive()
        finally:
            supervisor.stop_all()
    advice = ("if the trainer was killed for memory, lower train.max_tokens_per_micro_batch "
              "(4096 now) or set train.activation_checkpointing: true")
    for text in (restarted, str(failed.value)):
        assert "trainer was killed by SIGKILL (the kernel's out-of-memory killer killed " in text
        assert advice in text, text
    assert "restarting it (1 of 1)" in restarted


def test_a_rendezvous_port_is_held_until_rank_0_binds_it(monkeypatch):
    """The trainer's ranks on Ray rendezvous at a port picked before rank 0 starts: held
    by the picking process, no other program's bind, nor another pick, can take it in
    between (a run on two Ray nodes failed with EADDRINUSE there); torch's TCPStore binds
    it beside the hold. Ports are drawn apart from the seeded global ``random``, or every
    trainer seeded alike would pick the same ones."""
    import datetime
    import random
    import socket

    from torch.distributed import TCPStore

    from environments.inference import vllm_process
    from lachesis.run.layout import Placement

    port = Placement().rendezvous_port("trainer-0")
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as other, pytest.raises(OSError):
            other.bind((host, port))
    assert port not in {vllm_process.free_port() for _ in range(200)}
    store = TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
    store.set("rank", "0")
    assert store.get("rank") == b"0"
    draws = []
    for _ in range(2):
        monkeypatch.setattr(vllm_process, "_HANDED_OUT", set())
        random.seed(0)
        draws.append([vllm_process.free_port() for _ in range(5)])
    assert draws[0] != draws[1]


def test_a_guard_whose_starter_died_before_it_armed_runs_nothing(tmp_path):
    """A guard started just before its supervisor dies would find the reaper as its parent
    and keep running (orphans seen when a suite run was interrupted): it checks the pid
    its starter gave it, and ends its group before the command starts."""
    from lachesis.run.processes import GUARD_PARENT_VARIABLE

    def guard(parent: int) -> tuple[int, bool]:
        marker = tmp_path / f"ran-{parent}"
        proc = subprocess.run([sys.executable, "-m", "lachesis.run.guard", "touch", str(marker)],
                              cwd=REPO, env={**os.environ, GUARD_PARENT_VARIABLE: str(parent)},
                              start_new_session=True, timeout=60)
        return proc.returncode, marker.exists()

    assert guard(os.getpid()) == (0, True)
    assert guard(1) == (-signal.SIGKILL, False)  # 1: not its parent, as after a reaping


def test_a_one_process_trainer_gets_a_thread_count_unless_the_run_sets_one(tmp_path,
                                                                         monkeypatch):
    """Torch's default (a thread per core) beside vLLM's CPU engine made the quickstart's
    update 2.8x slower on 2 cores (issue 44); torchrun sets its own. The warm start runs
    before anything else of the run: it gets every core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    one = config(tmp_path, train={"batch_size": 8, "steps": 2})
    assert build_layout(one).trainer.env["OMP_NUM_THREADS"] == "1"
    (warm_start,) = trainer_processes(one, "warm_start", tmp_path / "ws.yaml", None,
                                      Placement(), alone=True)
    assert warm_start.env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert build_layout(one).trainer.env["OMP_NUM_THREADS"] == "7"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice reaches it unchanged
    assert "OMP_NUM_THREADS" not in build_layout(one).trainer.env
    assert "OMP_NUM_THREADS" not in build_layout(config(tmp_path)).trainer.env  # torchrun
