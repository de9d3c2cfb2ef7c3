"""``lachesis run CONFIG --ray ADDRESS``: the same processes as on one machine, placed on
the nodes of a Ray cluster (the ``ray`` extra: ``pip install 'lachesis-rl[ray]'``).

Each place of the run (``api``, ``vllm-0``, ``env-LABEL``, ``trainer-0``, ...) is one Ray
actor, a :class:`ProcessRunner`, on the node Ray gives it:

* the trainer's ranks: a placement group with a bundle per rank (one GPU each, or one CPU
  on a cluster without GPUs), spread as ``ray.trainer_strategy`` says; the ranks
  rendezvous at rank 0's node as under torchrun (``MASTER_ADDR``, ``MASTER_PORT``,
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; the ranks on one node see all of that node's
  ranks' GPUs, like torchrun's workers);
* each vLLM replica: a placement group of one bundle (``tensor_parallel_size`` GPUs on one
  node);
* the API and the env servers: on the node whose resource ``ray.nodes`` names for them,
  else where Ray puts them; an env's own server (OpenEnv) in the place of its env's
  servers, on loopback there.

An actor runs its commands as its own children, under the same guard as on one machine
(:mod:`lachesis.run.guard`). When the actor dies (its driver, the supervisor, was killed
outright, or the job ended), Ray SIGKILLs the actor's children, the guards, which then
cannot take their process groups with them: a watcher that each actor leaves detached on
its node (``python -m lachesis.run.ray_cluster watch``) kills whatever the actor started,
once the actor is gone. The supervisor on the head reads their output into the run's log files
(``runs/NAME/logs/``) and their exits as it does for local processes: a process that dies
stops the run with its log's tail, a vLLM replica is restarted.

The run directory must be one path on every node, on a shared filesystem (the trainer's
metrics, checkpoints and synced weights, the settings files): each actor checks that it
reads the run's id there before anything starts.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from environments.settings import TOKEN_VARIABLE
from lachesis.run.config import RunConfig
from lachesis.run.layout import Placement, free_port, held_port, url_answers
from lachesis.run.processes import GUARD_PARENT_VARIABLE

log = logging.getLogger("lachesis.run")
RUNNER_VARIABLE = "LACHESIS_RAY_RUNNER"
INSTALL_HINT = "pip install 'lachesis-rl[ray]'"
READ_CHUNK = 1 << 20
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached."""


class PlacementFailed(RuntimeError):
    """A process cannot be placed on the cluster; the message says which and why."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"--ray needs Ray, which is not installed: {INSTALL_HINT} "
                             "(the `ray` extra)") from None
    return ray


def connect(address: str) -> Any:
    """Join the Ray cluster at ``address`` (``auto``: the one started on this machine with
    ``ray start``) as its driver; returns the ``ray`` module."""
    if address.rsplit(":", 1)[0].strip("[]") in LOOPBACK_HOSTS:
        # Ray rewrites a loopback address to this machine's outward one, where a cluster
        # started on loopback (`--node-ip-address 127.0.0.1`) does not listen, unless
        # told that this machine's cluster is local only (read when Ray is imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = import_ray()
    if ray.is_initialized():
        return ray
    runtime_env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}} \
        if os.environ.get("PYTHONPATH") else None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING",
                 runtime_env=runtime_env)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise RayUnavailable(f"cannot join the Ray cluster at {address}: {error} (start it "
                             "with `ray start --head`; docs/multi-node.md)") from None
    return ray


def alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def uses_shared_memory_sync(config: RunConfig, gpus: bool) -> bool:
    """Whether the trainer's weight sync would go through a shared-memory file (the
    ``shm`` transfer backend, ``auto``'s choice without GPUs)."""
    from trainer.config import TrainConfig
    from trainer.vllm_sync import sync_method

    train = TrainConfig.model_validate({**config.rl_train, "model": config.model})
    if sync_method(train) != "transfer":
        return False
    backend = train.transfer_backend
    return backend == "shm" or (backend == "auto" and not gpus)


def ray_problems(config: RunConfig, nodes: list[dict[str, Any]]) -> list[str]:
    """What cannot work on a cluster of ``nodes`` (Ray's node records), one line each."""
    problems = []
    gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in nodes)
    if len(nodes) > 1 and uses_shared_memory_sync(config, gpus > 0):
        problems.append(
            f"train: the weight sync would go through shared memory (transfer_backend "
            f"{config.rl_train.get('transfer_backend', 'auto')}"
            f"{', which is shm without GPUs' if gpus == 0 else ''}), which reaches only "
            f"servers on the trainer's machine, and this Ray cluster has {len(nodes)} nodes: "
            "set train.transfer_backend to nccl (GPUs) or gloo (CPUs), the in-memory sync "
            "over the network, or train a LoRA adapter (lora:), or use weight_sync: disk "
            "with the run directory on a shared filesystem")
    resources = {r for n in nodes for r in n.get("Resources", {})}
    for pattern, resource in sorted(config.ray.nodes.items()):
        if resource not in resources:
            problems.append(f"ray.nodes: {pattern} is to go where resource {resource!r} is, "
                            "but no node of the cluster has it (give it to a node with "
                            f"`ray start --resources '{{\"{resource}\": 1}}'`)")
    return problems


def print_ray_plan(config: RunConfig, address: str) -> int:
    """``--plan --ray ADDRESS``: the cluster's nodes and what cannot work on it (0: none);
    where each process goes is Ray's choice at start, within what the config names."""
    try:
        nodes = alive_nodes(connect(address))
    except RayUnavailable as error:
        print(f"ray: {error}", flush=True)
        return 1
    lines = ["", f"Ray cluster at {address}: {len(nodes)} node(s) (the hosts and ports above "
             "are this machine's; on the cluster each process gets its node's)"]
    for node in nodes:
        resources = {k: v for k, v in node.get("Resources", {}).items()
                     if not k.startswith(("node:", "memory", "object_store_memory"))}
        lines.append(f"  {node.get('NodeManagerHostname', '?')} "
                     f"({node.get('NodeManagerAddress', '?')}): "
                     + ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())))
    placed = [f"trainer: {config.train_nproc} rank(s), {config.ray.trainer_strategy}"]
    placed += [f"{pattern}: where {resource} is"
               for pattern, resource in sorted(config.ray.nodes.items())]
    lines.append("placement: " + "; ".join(placed))
    problems = ray_problems(config, nodes)
    if problems:
        lines.append(f"problems on the cluster ({len(problems)}): the run would not start")
        lines += [f"  - {p}" for p in problems]
    else:
        lines.append("problems on the cluster: none found")
    print("\n".join(lines), flush=True)
    return 1 if problems else 0


class ProcessRunner:
    """A Ray actor that runs the commands of one place of the run as its children and
    hands their output and exits to the supervisor. (Made a Ray actor class by
    :func:`runner_class`, so that this module imports without Ray.)"""

    def __init__(self, run_id: str, cwd: str, environment: dict[str, str]):
        self.run_id = run_id
        self.cwd = cwd
        self.environment = environment
        self.dir = Path(tempfile.mkdtemp(prefix=f"lachesis-ray-{run_id}-"))
        self.children: dict[str, tuple[subprocess.Popen, Path, Path | None]] = {}
        self.marker = uuid.uuid4().hex
        """Every process this actor starts carries ``LACHESIS_RAY_RUNNER=marker``."""
        # Detached twice over (the launcher exits at once), so that Ray, which kills the
        # actor's children when the actor dies, leaves the watcher alone.
        subprocess.run([sys.executable, "-m", "lachesis.run.ray_cluster", "watch",
                        str(os.getpid()), self.marker, str(self.dir)], check=True,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL,
                       env={k: v for k, v in {**os.environ, **environment}.items()
                            if k != "LACHESIS_RUN_ID"})  # it outlives the actor, not the run

    def info(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "host": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()],
                "hostname": os.uname().nodename}

    def free_port(self, host: str) -> int:
        return free_port(host)

    def answers(self, url: str) -> bool:
        """Whether ``url`` answers 2xx from this node (a server on its loopback)."""
        return url_answers(url)

    def held_port(self) -> int:
        return held_port()

    def reads(self, path: str, content: str) -> bool:
        """Whether ``path`` holds ``content`` here (the run directory is shared)."""
        try:
            return (Path(self.cwd) / path).read_text().strip() == content
        except OSError:
            return False

    def start(self, name: str, command: list[str], env: dict[str, str],
              separate_stdout: bool) -> int:
        self.stop(name, 5.0)
        log = self.dir / f"{name}.log"
        out = self.dir / f"{name}.out" if separate_stdout else None
        with open(log, "wb") as log_file, \
                (open(out, "wb") if out else contextlib.nullcontext(log_file)) as out_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lachesis.run.guard", *command], cwd=self.cwd,
                env={**os.environ, **self.environment, "PYTHONUNBUFFERED": "1", **env,
                     RUNNER_VARIABLE: self.marker, GUARD_PARENT_VARIABLE: str(os.getpid())},
                stdin=subprocess.DEVNULL, stdout=out_file, stderr=log_file,
                start_new_session=True)
        self.children[name] = (proc, log, out)
        return proc.pid

    def poll(self, name: str, offset: int) -> tuple[bytes, int | None]:
        """The log from ``offset`` on (at most a chunk), and the exit code once the
        process has exited and its whole log has been read."""
        proc, log, _ = self.children[name]
        code = proc.poll()
        with open(log, "rb") as f:
            f.seek(offset)
            chunk = f.read(READ_CHUNK)
        return chunk, (code if len(chunk) < READ_CHUNK else None)

    def stdout(self, name: str) -> bytes:
        out = self.children[name][2]
        return out.read_bytes() if out is not None and out.exists() else b""

    def stop(self, name: str, grace_s: float = 15.0) -> int | None:
        from environments.inference.vllm_process import stop_process_group

        if name not in self.children:
            return None
        return stop_process_group(self.children[name][0], grace_s)

    def stop_all(self, grace_s: float = 15.0) -> None:
        """Stop every process; their output is not needed any more."""
        for name in list(self.children):
            self.stop(name, grace_s)
        shutil.rmtree(self.dir, ignore_errors=True)


def runner_class(ray: Any) -> Any:
    return ray.remote(ProcessRunner)


class RayChild:
    """A process of the run on a Ray node, seen from the supervisor as a local
    :class:`lachesis.run.processes.ChildProcess` is: started, polled, stopped, its log in
    ``log_path`` on the head."""

    oom_kills_at_start = None
    """Not known: the head's /proc/vmstat does not count another node's kills."""

    def __init__(self, runner: Any, ray: Any, name: str, command: list[str], log_path: Path,
                 env: dict[str, str], stdout_path: Path | None = None, where: str = ""):
        self.runner, self.ray = runner, ray
        self.name, self.command, self.log_path = name, command, log_path
        self.env, self.stdout_path, self.where = env, stdout_path, where
        self.proc: SimpleNamespace | None = None
        self.offset = 0
        self.code: int | None = None

    def start(self) -> RayChild:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
        pid = self.ray.get(self.runner.start.remote(self.name, self.command, self.env,
                                                    self.stdout_path is not None))
        self.proc, self.offset, self.code = SimpleNamespace(pid=pid), 0, None
        return self

    def _read(self) -> None:
        """Append the process's new output to the log; note its exit."""
        while self.code is None:
            try:
                chunk, code = self.ray.get(self.runner.poll.remote(self.name, self.offset))
            except self.ray.exceptions.RayError as error:  # the actor or its node is gone
                with open(self.log_path, "ab") as log:
                    log.write(f"lachesis run: lost the process on {self.where}: "
                              f"{type(error).__name__}: {error}\n".encode())
                self.code = -1
                return
            if chunk:
                with open(self.log_path, "ab") as log:
                    log.write(chunk)
                self.offset += len(chunk)
            if code is not None:
                self.code = code
                if self.stdout_path is not None:
                    self.stdout_path.write_bytes(
                        self.ray.get(self.runner.stdout.remote(self.name)))
            if len(chunk) < READ_CHUNK:
                return

    @property
    def returncode(self) -> int | None:
        if self.proc is None:
            return None
        self._read()
        return self.code

    @property
    def running(self) -> bool:
        return self.proc is not None and self.returncode is None

    def log_tail(self, n_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n_lines:])

    def stop(self, grace_s: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.code is None:
            with contextlib.suppress(self.ray.exceptions.RayError):
                self.ray.get(self.runner.stop.remote(self.name, grace_s))
        self._read()
        return self.code

    def kill(self) -> int | None:
        """SIGKILL its process group at once (a hung process: nothing to wait for)."""
        return self.stop(grace_s=0.0)


class RayPlacement(Placement):
    """Each place of the run is a :class:`ProcessRunner` actor on a node of the cluster,
    created when the layout first asks where the place is."""

    per_rank = True

    def __init__(self, config: RunConfig, run_id: str):
        self.ray = ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._placement_group = placement_group
        self._in_group = PlacementGroupSchedulingStrategy
        self.config = config
        self.run_id = run_id
        self.gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.runner_class = runner_class(ray)
        self.runners: dict[str, Any] = {}
        self.infos: dict[str, dict[str, Any]] = {}
        self.groups: dict[str, Any] = {}
        environment = {k: v for k, v in os.environ.items()  # the token: with each start
                       if k == "PYTHONPATH" or k.startswith("LACHESIS_") and k != TOKEN_VARIABLE}
        self.environment = {**environment, "LACHESIS_RUN_ID": run_id}

    # -- places ---------------------------------------------------------------------------
    def node_resource(self, name: str) -> dict[str, float]:
        """The resource ``ray.nodes`` names for place ``name`` (a sliver of it)."""
        group = "trainer" if name.startswith("trainer-") else \
            "vllm" if name == "vllm" or name.startswith("vllm-") else None
        for pattern, resource in self.config.ray.nodes.items():
            if fnmatch.fnmatchcase(name, pattern) or pattern == group:
                return {resource: 0.001}
        return {}

    def _group(self, key: str, bundles: list[dict[str, float]], strategy: str,
               timeout_s: float = 300.0) -> Any:
        if key not in self.groups:
            group = self._placement_group(bundles, strategy=strategy)
            if not group.wait(timeout_s):
                self.ray.util.remove_placement_group(group)
                free = self.ray.available_resources()
                raise PlacementFailed(
                    f"Ray cannot place {key}: {len(bundles)} bundle(s) of {bundles[0]} "
                    f"({strategy}) not available after {timeout_s:.0f} s; the cluster has "
                    f"free {free}")
            self.groups[key] = group
        return self.groups[key]

    def runner(self, name: str) -> Any:
        """The actor of place ``name`` (created, and checked, on first use)."""
        if name in self.runners:
            return self.runners[name]
        options: dict[str, Any] = {"name": f"lachesis-{self.run_id}-{name}",
                                   "max_concurrency": 4}
        resource = self.node_resource(name)
        if name.startswith("trainer-"):
            rank, nproc = int(name.split("-")[1]), self.config.train_nproc
            bundle = {"GPU": 1.0, "CPU": 1.0} if self.gpus else {"CPU": 1.0}
            group = self._group("trainer", [{**bundle, **resource}] * nproc,
                                self.config.ray.trainer_strategy)
            options.update(num_cpus=1, num_gpus=1 if self.gpus else 0,
                           scheduling_strategy=self._in_group(group, rank))
        elif name == "vllm" or name.startswith("vllm-"):
            tp = self.config.vllm.tensor_parallel_size
            bundle = {"GPU": float(tp), "CPU": 1.0} if self.gpus else {"CPU": 1.0}
            group = self._group(name, [{**bundle, **resource}], "STRICT_PACK")
            options.update(num_cpus=1, num_gpus=tp if self.gpus else 0,
                           scheduling_strategy=self._in_group(group, 0))
        else:
            options.update(num_cpus=0, resources=resource)
        runner = self.runner_class.options(**options).remote(
            self.run_id, os.getcwd(), self.environment)
        info = self.ray.get(runner.info.remote())
        run_id_file = str(self.config.run_dir / "run_id")
        if not self.ray.get(runner.reads.remote(run_id_file, self.run_id)):
            self.ray.kill(runner)
            raise PlacementFailed(
                f"{name} was placed on node {info['hostname']} ({info['host']}), which does "
                f"not see this run's {run_id_file} under {os.getcwd()}: the run directory "
                "must be on a filesystem shared by every node, at the same path")
        self.runners[name], self.infos[name] = runner, info
        log.info("placement: %s", json.dumps({"place": name, **info}))
        return runner

    def host(self, name: str) -> str:
        self.runner(name)
        return self.infos[name]["host"]

    def port(self, name: str, port: int | None = None) -> int:
        return port or self.ray.get(self.runner(name).free_port.remote(self.host(name)))

    def local_port(self, name: str) -> int:
        return self.ray.get(self.runner(name).free_port.remote("127.0.0.1"))

    def server_place(self, label: str) -> str | None:
        return f"env-{label}"

    def answers(self, name: str, url: str) -> bool:
        return self.ray.get(self.runner(name).answers.remote(url))

    def rendezvous_port(self, name: str) -> int:
        return self.ray.get(self.runner(name).held_port.remote())  # held by the actor

    def device_env(self, name: str, devices: list[int] | None) -> dict[str, str]:
        return {}  # Ray gives each actor its GPUs (its CUDA_VISIBLE_DEVICES)

    def rank_env(self, rank: int, world: int) -> dict[str, str]:
        """Ranks on one node see that node's ranks' GPUs, each its own as LOCAL_RANK."""
        for r in range(world):
            self.runner(f"trainer-{r}")
        infos = [self.infos[f"trainer-{r}"] for r in range(world)]
        node = infos[rank]["node_id"]
        local = [r for r in range(world) if infos[r]["node_id"] == node]
        env = {"LOCAL_RANK": str(local.index(rank)), "LOCAL_WORLD_SIZE": str(len(local)),
               "GROUP_RANK": str(sorted({i["node_id"] for i in infos}).index(node))}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for r in local for g in infos[r]["gpus"])
        return env

    def where(self, name: str) -> str:
        """``name``'s node, for the console."""
        info = self.infos.get(name)
        return f"{info['hostname']} ({info['host']}) node {info['node_id'][:8]}" if info \
            else "not placed"

    # -- processes ------------------------------------------------------------------------
    def child(self, name: str, where: str, command: list[str], log_path: Path,
              env: dict[str, str], stdout_path: Path | None = None) -> RayChild:
        return RayChild(self.runner(where), self.ray, name, command, log_path, env,
                        stdout_path, where)

    def close(self) -> None:
        """Stop every actor's processes, then the actors and their placement groups."""
        runners = list(self.runners.values())
        with contextlib.suppress(self.ray.exceptions.RayError):
            self.ray.get([r.stop_all.remote(5.0) for r in runners], timeout=60)
        for runner in runners:
            with contextlib.suppress(self.ray.exceptions.RayError, ValueError):
                self.ray.kill(runner)
        for group in self.groups.values():
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(group)
        self.runners.clear()
        self.groups.clear()


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def watch(actor_pid: int, marker: str, directory: str) -> None:
    """Wait until the actor process ``actor_pid`` is gone, then SIGKILL every process
    that carries ``LACHESIS_RAY_RUNNER=marker`` and remove the actor's ``directory``."""
    import signal

    from lachesis.run.processes import processes_of_run

    started = _start_time(actor_pid)
    while started is not None and _start_time(actor_pid) == started:
        time.sleep(1.0)
    for _ in range(10):
        left = processes_of_run(marker, RUNNER_VARIABLE)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "watch":  # start the watcher detached, return
        subprocess.Popen([sys.executable, "-m", "lachesis.run.ray_cluster", "watching",
                          *argv[1:]], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return 0
    if len(argv) == 4 and argv[0] == "watching":
        watch(int(argv[1]), argv[2], argv[3])
        return 0
    print("usage: python -m lachesis.run.ray_cluster watch ACTOR_PID MARKER DIRECTORY",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
