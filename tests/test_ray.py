"""``lachesis run CONFIG --ray ADDRESS`` on a local two-node Ray cluster: two raylets on
this machine, as ``ray.cluster_utils.Cluster`` starts them, each with its own CPUs and a
custom resource (``node_a``, ``node_b``) that the config names nodes by."""

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

from lachesis.run.config import RunConfig
from lachesis.run.layout import Placement, trainer_processes
from lachesis.run.processes import processes_of_run
from lachesis.run.ray_cluster import ray_problems

CONFIG = REPO / "configs" / "ray_cpu_two_nodes.yaml"


@pytest.fixture(scope="module")
def ray_model(tmp_path_factory) -> Path:
    """The config's tiny model (``build_tiny_model``), built once for the module's runs as
    each run would build it (a run that finds it there builds none: 10 s of CPU each)."""
    from lachesis.tiny_model import make_tiny_model

    settings = yaml.safe_load(CONFIG.read_text())["build_tiny_model"]
    return make_tiny_model(tmp_path_factory.mktemp("ray_model") / "model", **settings)


def write_config(tmp_path: Path, model: Path, name: str, **changes) -> Path:
    """configs/ray_cpu_two_nodes.yaml with its run under ``tmp_path``, on ``model``."""
    config = yaml.safe_load(CONFIG.read_text())
    config.update(name=name, runs_dir=str(tmp_path / "runs"), model=str(model), **changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def lachesis_run(config: Path, address: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lachesis.cli", "run", str(config),
                             "--ray", address, *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two nodes on this machine; yields its address."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # Both nodes on loopback: the run's servers listen on, and every connection goes to,
    # 127.0.0.1, never this machine's other addresses.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 1}, "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=2, resources={"node_b": 1}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def safetensors_weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for path in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(path))
    assert weights, f"no weights in {directory}"
    return weights


@pytest.mark.slow  # 133 s; runs on the two nodes: the killed-rank and supervisor tests below
@pytest.mark.ray
@pytest.mark.vllm
def test_a_run_on_two_ray_nodes_ends_on_the_weights_of_a_one_machine_run(two_nodes, ray_model,
                                                                          tmp_path):
    """The whole system on the two nodes: the trainer's two ranks (gloo) one per node, the
    API on node_a, the env server and its evaluation on node_b, vLLM where Ray puts it;
    every process's log reaches the head's run directory. RL sampling is not reproducible
    run to run (which groups fill which batch depends on timing), so the weights are
    compared on the deterministic part of the run: the 2-rank SFT warm start ends on the
    weights a one-machine 2-process run (torchrun, as `lachesis run` starts it without
    --ray) of the same settings ends on. While it trains, the run is guarded by its token
    (test_security.py), every server on 127.0.0.1, the nodes' address."""
    from test_run import wait_for
    from test_security import check_the_run_is_guarded, trainer_pids

    config_path = write_config(tmp_path, ray_model, "two_nodes")
    started = time.monotonic()
    run = lachesis_run(config_path, two_nodes)
    run_dir = tmp_path / "runs" / "two_nodes"
    # while it trains: guarded by its token, every server on 127.0.0.1
    # (the trainer starts while vLLM does; the env server once everything answers)
    wait_for(lambda: (run_dir / "logs" / "env-arithmetic_tool.log").exists(), 900,
             "the RL phase", run)
    rid = (run_dir / "run_id").read_text().strip()
    wait_for(lambda: len(trainer_pids(processes_of_run(rid))) >= 4, 60,  # 2 ranks, 2 guards
             "the RL ranks", run)
    check_the_run_is_guarded(run_dir, processes_of_run(rid))
    out, err = run.communicate(timeout=1200)
    seconds = time.monotonic() - started
    assert run.returncode == 0, err[-4000:]
    print(out)  # the head's console (pytest -s shows it)
    assert processes_of_run((run_dir / "run_id").read_text().strip()) == []
    run_log = (run_dir / "run.log").read_text()

    # where the processes went: the ranks on the two nodes, api and env as named
    placed = run_log.split("on the Ray cluster: ")[1].splitlines()[0]
    nodes = dict(part.split(" on ", 1) for part in placed.split(", "))
    assert set(nodes) == {"api", "vllm", "env-arithmetic_tool", "trainer-0", "trainer-1"}
    ranks_log = [(run_dir / "logs" / f"trainer-{r}.log").read_text() for r in (0, 1)]
    node_ids = [json.loads(line.split("placement: ", 1)[1])
                for line in run_log.splitlines() if "placement: " in line]
    by_place = {p["place"]: p["node_id"] for p in node_ids}
    assert by_place["trainer-0"] != by_place["trainer-1"]  # STRICT_SPREAD: two nodes
    assert by_place["api"] != by_place["env-arithmetic_tool"]  # node_a, node_b
    assert by_place["env-arithmetic_tool"] in (by_place["trainer-0"], by_place["trainer-1"])

    # the logs reached the head: warm start and RL ranks, API, vLLM, env, evaluation
    logs = {p.stem for p in (run_dir / "logs").glob("*.log")}
    assert {"api", "vllm", "env-arithmetic_tool", "trainer-0", "trainer-1", "warm_start-0",
            "warm_start-1", "eval-after-arithmetic_tool"} <= logs
    assert "alignment check: mean |trainer - vLLM| logprob" in ranks_log[0], \
        "rank 0 logged no alignment check; its log but progress bars:\n" + "\n".join(
            line for line in ranks_log[0].splitlines() if "it/s]" not in line)[-6000:]
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["sync_seconds"] > 0 for m in metrics)
    assert "gloo" in (run_dir / "logs" / "vllm.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "arithmetic_tool" in summary["after"]

    # the same warm start on one machine: 2 processes under torchrun
    config = RunConfig.load(config_path, check=False)
    local_yaml = tmp_path / "warm_start_local.yaml"
    settings = yaml.safe_load((run_dir / "configs" / "warm_start.yaml").read_text())
    local_dir = tmp_path / "local_warm_start"
    local_yaml.write_text(yaml.safe_dump({**settings, "run_dir": str(local_dir)}))
    (local,) = trainer_processes(config, "warm_start", local_yaml, None, Placement())
    assert "torch.distributed.run" in local.command
    subprocess.run(local.command, cwd=REPO, check=True, capture_output=True, timeout=600)
    on_ray = safetensors_weights(run_dir / "warm_start" / "final")
    here = safetensors_weights(max((local_dir / "checkpoints").glob("step_*")))
    import torch

    assert on_ray.keys() == here.keys()
    first = safetensors_weights(Path(config.model))
    assert any(not torch.equal(first[k], on_ray[k]) for k in on_ray)  # SFT moved them
    for name in on_ray:
        assert torch.allclose(on_ray[name], here[name], rtol=0, atol=1e-6), name
    print(f"two-node run: {seconds:.0f} s")


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.slow  # 66 s; one-machine restarts are in test_run's whole-node test
def test_a_replica_killed_on_its_node_is_restarted_there(two_nodes, ray_model, tmp_path):
    """As on one machine (tests/test_run.py): a vLLM replica killed after step 1 is
    restarted by the supervisor, by the same actor on the same node, on the synced
    weights; the trainer's ranks load the newest weights into it when it is back, and the
    run finishes every step."""
    from test_run import kill_replica_until_it_is_back

    # Steps of this run take about 0.2 s: with 4, the run ended before the test saw the
    # trainer leave the replica behind (its log is read every 0.5 s) and could hold it.
    steps = 40
    base = yaml.safe_load(CONFIG.read_text())
    config_path = write_config(
        tmp_path, ray_model, "restart", warm_start=None, evaluate=False,
        vllm={**base["vllm"], "replicas": 2},
        train={**base["train"], "steps": steps, "weight_sync": "disk",
               "check_sync_every": True})
    run = lachesis_run(config_path, two_nodes)
    run_dir = tmp_path / "runs" / "restart"
    try:
        kill_replica_until_it_is_back(run, run_dir, trainer_log="trainer-0.log")
        out, err = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-4000:]
    assert processes_of_run((run_dir / "run_id").read_text().strip()) == []
    metrics = [json.loads(line) for line in (run_dir / "trainer" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["sync_check_mean_abs_diff"] < 1e-3 for m in metrics)
    assert metrics[-1]["sync_checked_servers"] == 2 and metrics[-1]["vllm_behind"] == 0
    assert json.loads((run_dir / "summary.json").read_text())["vllm_restarts"] == {"vllm-1": 1}
    assert " is back: loaded " in (run_dir / "logs" / "trainer-0.log").read_text()
    second = (run_dir / "logs" / "vllm-1.log").read_text().split("\n$ ")[1].split("\n")[0]
    # restarted on synced weights: a hard-linked copy of the newest version (as in
    # tests/test_run.py)
    assert "/trainer/restart/vllm-1" in second
    started = [line.split("started vllm-1 on ", 1)[1].split(" (pid")[0]
               for line in (run_dir / "run.log").read_text().splitlines()
               if "started vllm-1 on " in line]
    assert len(started) == 2 and started[0] == started[1]  # the same node both times


LONG_WARM_START = {"env": "arithmetic_tool", "demonstrations": 64,
                   "train": {"steps": 10000, "batch_size": 8, "micro_batch_size": 8,
                             "tensorboard": False}}


def wait_for_a_warm_start_step(run: subprocess.Popen, run_dir: Path) -> None:
    metrics = run_dir / "warm_start" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the warm start never finished a step"
        time.sleep(0.5)


@pytest.mark.ray
def test_a_killed_rank_fails_the_run_and_nothing_is_left(two_nodes, ray_model, tmp_path):
    """A trainer rank killed on its node stops the run as a dead process does on one
    machine: exit 1, the rank's name, exit code and log tail; every process goes. (Killed
    during the warm start, so no vLLM is started.)"""
    config_path = write_config(tmp_path, ray_model, "killed", warm_start=LONG_WARM_START)
    run = lachesis_run(config_path, two_nodes)
    run_dir = tmp_path / "runs" / "killed"
    wait_for_a_warm_start_step(run, run_dir)
    rid = (run_dir / "run_id").read_text().strip()
    rank_1 = [pid for pid in processes_of_run(rid)
              if Path(f"/proc/{pid}/environ").read_bytes().find(b"\0RANK=1\0") >= 0
              and b"lachesis.run.guard" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(rank_1) == 1, rank_1
    os.kill(rank_1[0], signal.SIGKILL)
    out, err = run.communicate(timeout=180)
    assert run.returncode == 1, err[-3000:]
    assert "warm_start-1 was killed by SIGKILL" in err and "warm_start-1.log" in err
    deadline = time.monotonic() + 30
    while processes_of_run(rid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of_run(rid) == []


@pytest.mark.ray
def test_killing_the_supervisor_outright_leaves_no_process_on_the_nodes(two_nodes, ray_model,
                                                                        tmp_path):
    """SIGKILL gives the supervisor (the Ray driver) no chance to clean up: Ray ends its
    actors and kills their children (the guards), and each actor's watcher kills what the
    guard cannot take with it any more."""
    config_path = write_config(tmp_path, ray_model, "supervisor_killed",
                               warm_start=LONG_WARM_START)
    run = lachesis_run(config_path, two_nodes)
    run_dir = tmp_path / "runs" / "supervisor_killed"
    wait_for_a_warm_start_step(run, run_dir)
    rid = (run_dir / "run_id").read_text().strip()
    assert len(processes_of_run(rid)) >= 4  # two ranks, each under its guard
    run.kill()
    run.communicate(timeout=30)
    deadline = time.monotonic() + 60
    while processes_of_run(rid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of_run(rid) == []


@pytest.mark.ray
def test_shared_memory_weight_sync_is_refused_across_nodes_before_anything_starts(
        two_nodes, tmp_path):
    config_path = write_config(tmp_path, tmp_path / "model", "shm", train={
        **yaml.safe_load(CONFIG.read_text())["train"], "transfer_backend": "auto"})
    run = lachesis_run(config_path, two_nodes)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 2
    assert "shared memory" in err and "2 nodes" in err and "gloo" in err and "lora" in err
    assert not (tmp_path / "runs" / "shm").exists()


def test_what_cannot_work_on_a_cluster_is_named():
    config = RunConfig.load(CONFIG, check=False)
    node = {"Alive": True, "Resources": {"CPU": 2.0, "node_a": 1.0, "node_b": 1.0}}
    assert ray_problems(config, [node, node]) == []
    shm = config.model_copy(update={"train": {**config.train, "transfer_backend": "shm"}})
    assert ray_problems(shm, [node]) == []  # one node: shared memory reaches every server
    (problem,) = ray_problems(shm, [node, node])
    assert "transfer_backend shm" in problem and "nccl" in problem
    gpu = {"Alive": True, "Resources": {"GPU": 8.0, "node_a": 1.0, "node_b": 1.0}}
    auto = config.model_copy(update={"train": {**config.train, "transfer_backend": "auto"}})
    assert ray_problems(auto, [gpu, gpu]) == []  # auto is nccl with GPUs
    assert "shm without GPUs" in ray_problems(auto, [node, node])[0]
    elsewhere = config.model_copy(update={"ray": config.ray.model_copy(
        update={"nodes": {"api": "node_c"}})})
    (problem,) = ray_problems(elsewhere, [node, node])
    assert "'node_c'" in problem and "ray start --resources" in problem


def test_ray_without_the_extra_names_the_install(tmp_path):
    """Where Ray cannot be imported, --ray says how to install it and starts nothing."""
    config_path = write_config(tmp_path, tmp_path / "model", "no_ray")
    code = ("import sys; sys.modules['ray'] = None; from lachesis.cli import main; "
            f"sys.exit(main(['run', {str(config_path)!r}, '--ray', 'auto']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "pip install 'lachesis-rl[ray]'" in result.stderr
    assert not (tmp_path / "runs" / "no_ray").exists()
