"""Where each process of ``lachesis run`` goes: its command line, devices, port, URL, log
and settings file, decided once from the run config. The supervisor starts what the
layout says; ``lachesis run CONFIG --plan`` prints it without starting anything.

* The rollout API: one process.
* vLLM: ``vllm.replicas`` servers, each with its own ``CUDA_VISIBLE_DEVICES``
  (``tensor_parallel_size`` devices) and port.
* The env servers: ``count`` per env, each told every replica's URL (it spreads its
  requests over them, least in flight); the env's ``weight`` in the API's mix is split
  evenly over its servers.
* The trainer: ``train.nproc`` processes under torchrun (one device each), told every
  replica's URL (every sync reaches each). On a Ray cluster (``--ray``), one process
  per rank instead, with the variables torchrun would set (``MASTER_ADDR``,
  ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
* For an env with a ``server`` (an OpenEnv server): that server, started first; an
  atroposlib env runs its own serve loop against the API, generating through one
  ``lachesis atropos-generate`` over the replicas.

Device indices are those the run itself sees: under ``CUDA_VISIBLE_DEVICES=4,5,6,7``,
device 0 is GPU 4.

Hosts and ports come from a :class:`Placement`: on this machine every process listens on
loopback; :class:`lachesis.run.ray_cluster.RayPlacement` puts each process on a node of a
Ray cluster first and answers with that node's address and a port free there. An env's
own server (``{host}``, ``{port}`` in its command) listens on loopback, beside the env's
servers (:meth:`Placement.server_place`): OpenEnv servers have no authentication. The
others want the run's token (docs/security.md).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.inference.dtypes import resolve_dtype
from lachesis.run.config import EnvSettings, RunConfig, env_facts, env_process_environment


LOOPBACK = "127.0.0.1"


def lachesis_command(*args: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "lachesis.cli", *args]


@dataclass
class Process:
    """One process of the run, as it will be started."""

    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables on top of the run's own."""
    devices: list[int] | None = None
    port: int | None = None
    url: str | None = None
    settings: tuple[Path, dict[str, Any]] | None = None
    """The settings file the command reads, and what the supervisor writes into it."""
    health_url: str | None = None
    """Up once this answers."""
    container: str | None = None
    """The docker container the command runs (removed when the run stops)."""
    slot: str | None = None
    """Where it runs when that is not its own place (:class:`Placement`): a trainer
    rank's, or an env server's for its evaluation."""
    guarded: bool = False
    """Its ``url`` refuses every request but its health check without the run's token."""

    @property
    def where(self) -> str:
        return self.slot or self.name


@dataclass
class EnvServer(Process):
    env_name: str = ""
    """The env's name in the config (``envs[].name``)."""
    label: str = ""
    kind: str = "lachesis"
    """``lachesis`` (``lachesis env serve``) or ``atropos`` (an atroposlib env's own serve
    loop, started once the trainer has registered)."""
    python: str | None = None
    env_label: str = ""
    """The env's label (``label`` without the server's number)."""
    first: bool = True
    """The env's first server (whose settings its evaluation uses)."""


@dataclass
class Layout:
    api: Process
    replicas: list[Process]
    envs: list[EnvServer]
    trainers: list[Process]
    """The trainer: one process (under torchrun when it has several ranks), or one per
    rank (:attr:`Placement.per_rank`)."""
    backends: list[Process] = field(default_factory=list)
    """Servers the envs talk to (OpenEnv servers), started before them."""
    bridge: Process | None = None
    """``lachesis atropos-generate`` over the replicas, for atroposlib envs."""

    @property
    def processes(self) -> list[Process]:
        return [self.api, *self.replicas, *self.backends,
                *([self.bridge] if self.bridge else []), *self.envs, *self.trainers]

    @property
    def trainer(self) -> Process:
        """The trainer's (first) process."""
        return self.trainers[0]

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]


def visible_devices(devices: list[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``devices`` (indices into what this process sees)."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in inherited.split(",")] if inherited else None
    return ",".join(ids[d] if ids is not None and d < len(ids) else str(d) for d in devices)


def _device_env(devices: list[int] | None) -> dict[str, str]:
    return {} if devices is None else {"CUDA_VISIBLE_DEVICES": visible_devices(devices)}


def free_port(host: str = "127.0.0.1") -> int:
    from environments.inference.vllm_process import free_port as pick

    return pick(host)


def url_answers(url: str, timeout_s: float = 2.0) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= response.status < 300
    except (OSError, ValueError):
        return False


def held_port() -> int:
    from environments.inference.vllm_process import hold_port

    return hold_port()


class Placement:
    """Where each process of the run goes: here, this machine, every process listening on
    loopback. Processes are asked for by the name of their place (``api``, ``vllm-0``,
    ``env-LABEL``, ``server-LABEL``, ``atropos-generate``, ``trainer-RANK``)."""

    per_rank = False
    """The trainer as one process per rank (else one torchrun process)."""

    def host(self, name: str) -> str:
        """The address ``name`` listens on and is reached at."""
        return LOOPBACK

    def port(self, name: str, port: int | None = None) -> int:
        """``port`` (configured), else a port free where ``name`` runs."""
        return port or free_port(self.host(name))

    def local_port(self, name: str) -> int:
        """A port free on loopback where ``name`` runs."""
        return free_port("127.0.0.1")

    def server_place(self, label: str) -> str | None:
        """Where the server of env ``label`` (an OpenEnv server, which has no
        authentication of its own) runs, listening on loopback: None, its own place (here:
        this machine); on a cluster, the place of the env's servers, its only clients."""
        return None

    def answers(self, name: str, url: str) -> bool:
        """Whether ``url`` answers (2xx) from where ``name`` runs."""
        return url_answers(url)

    def rendezvous_port(self, name: str) -> int:
        """A port for the trainer's rendezvous (torch's TCPStore) where ``name`` runs, held
        there until the run ends, so nothing takes it before rank 0 binds it."""
        return held_port()

    def device_env(self, name: str, devices: list[int] | None) -> dict[str, str]:
        """The environment that gives ``name`` its configured ``devices``."""
        return _device_env(devices)

    def rank_env(self, rank: int, world: int) -> dict[str, str]:
        """With :attr:`per_rank`: what torchrun would set for ``rank`` besides the master's
        address and the world (``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``)."""
        raise NotImplementedError("one torchrun process here: no per-rank environment")


def policy_model(config: RunConfig) -> str:
    """The model RL starts from: the warm start's result when there is one."""
    if config.warm_start is not None:
        return str(config.run_dir / "warm_start" / "final")
    return config.model


def build_layout(config: RunConfig, model: str | None = None,
                 place: Placement | None = None) -> Layout:
    """Every process of the RL phase (ports chosen now: the configured ones, else free
    ones; hosts and ports where ``place`` puts each process)."""
    from environments.inference.vllm_process import VLLMProcess
    from trainer.config import TrainConfig
    from trainer.vllm_sync import vllm_options

    model = model or policy_model(config)
    place = place or Placement()
    run_dir = config.run_dir
    logs, configs = run_dir / "logs", run_dir / "configs"

    api_host, api_port = place.host("api"), place.port("api", config.api.get("port"))
    api_url = f"http://{api_host}:{api_port}"
    api_yaml = configs / "api.yaml"
    api = Process("api", lachesis_command("api", "--config", str(api_yaml)),
                  logs / "api.log", port=api_port, url=api_url, guarded=True,
                  settings=(api_yaml, {
                      # atroposlib envs pace on their own groups, as the others do
                      "status_env_own_queue": True,
                      **config.api, "host": api_host, "port": api_port,
                      "db": run_dir / "api" / "queue.sqlite"}))

    v = config.vllm
    # What the trainer's weight sync needs of vLLM (LoRA, a weight-transfer backend).
    sync_args, sync_env = vllm_options(TrainConfig.model_validate(
        {**config.rl_train, "model": model}))
    tp_args = ["--tensor-parallel-size", str(v.tensor_parallel_size)] \
        if v.tensor_parallel_size > 1 else []
    determinism_args = deterministic_vllm_args(v.max_model_len) if config.deterministic \
        else []
    replicas = []
    for i, devices in enumerate(config.replica_devices):
        name = "vllm" if v.replicas == 1 else f"vllm-{i}"
        server = VLLMProcess(model, host=place.host(name),
                             port=place.port(name, v.port + i if v.port else None),
                             max_model_len=v.max_model_len,
                             dtype=resolve_dtype(v.dtype) if devices is None
                             else "bfloat16" if v.dtype == "auto" else v.dtype,
                             kv_cache_space_gib=v.kv_cache_gib, dev_mode=True,
                             gpu_memory_utilization=v.gpu_memory_utilization,
                             served_model_name="policy", guarded=True,
                             access_log=v.access_log,
                             extra_args=[*tp_args, *determinism_args, *v.args, *sync_args],
                             env={**v.environment, **sync_env},
                             log_path=logs / f"{name}.log")
        environment = server.environment()
        env = {k: environment[k] for k in ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE",
                                           "VLLM_ENABLE_V1_MULTIPROCESSING",
                                           *v.environment, *sync_env) if k in environment}
        replicas.append(Process(name, server.command(), logs / f"{name}.log",
                                env={**env, **place.device_env(name, devices)}, devices=devices,
                                port=server.port, url=server.url, guarded=True))
    urls = [r.url for r in replicas]

    backends, envs, bridge = [], [], None
    for env in config.envs:
        name, kind = env.name, _kind(env)
        beside = None
        if env.server is not None:
            backends.append(env_backend(env, logs, place))
            beside = backends[-1].slot  # its env servers run where it listens on loopback
            name = name.replace("{port}", str(backends[-1].port)).replace("{host}", LOOPBACK)
        if kind == "atropos" and bridge is None:
            host, port = place.host("atropos-generate"), place.port("atropos-generate")
            bridge = Process("atropos-generate", lachesis_command(
                "atropos-generate", *[a for u in urls for a in ("--vllm-url", u)],
                "--model", "policy", "--host", host, "--port", str(port)),
                logs / "atropos-generate.log", port=port, url=f"http://{host}:{port}",
                health_url=f"http://{host}:{port}/health", guarded=True)
        environment = env_process_environment(env, {})
        for k in range(env.count):
            label = env.label if env.count == 1 else f"{env.label}-{k}"
            env_yaml = configs / f"env-{label}.yaml"
            if kind == "atropos":
                settings = {
                    "env": {"max_batches_offpolicy": 1,  # paced: at most a batch ahead
                            **(env.settings.get("env") or {}), "rollout_server_url": api_url,
                            "tokenizer_name": model, "use_wandb": False,
                            "inference_weight": env.weight / env.count},
                    "openai": {**(env.settings.get("openai") or {}),
                               "base_url": f"{bridge.url}/v1", "tokenizer_name": model,
                               "model_name": "policy", "server_type": "vllm"}}
            else:
                lockstep = {"seeded_sampling": True, "groups_per_policy_version":
                            config.lockstep_groups()} if config.deterministic else {}
                # a name on a port the run picks would change at --resume: the label
                stable = {"env_name": env.label} if env.server is not None and \
                    env.name != name else {}
                settings = {
                    "max_queued_groups": config.groups_per_batch(env),  # paced (a batch)
                    **stable, **env.settings, **lockstep, "api_url": api_url, "inference_servers": urls,
                    "tokenizer": model, "env_weight": env.weight / env.count,
                    "jsonl_out": run_dir / "trajectories" / f"{label}.jsonl",
                    "spool_path": run_dir / "spool" / f"{label}.jsonl",
                    "state_path": run_dir / "state" / f"{label}.json"}
            envs.append(EnvServer(
                f"env-{label}", lachesis_command("env", "serve", name, "--config",
                                                 str(env_yaml), python=env.python),
                logs / f"env-{label}.log", env=environment, settings=(env_yaml, settings),
                env_name=name, label=label, kind=kind, python=env.python,
                env_label=env.label, first=k == 0, slot=beside))

    train_yaml = configs / "train.yaml"
    trainers = trainer_processes(config, "trainer", train_yaml, {
        **config.rl_train, **({"deterministic": True} if config.deterministic else {}),
        "model": model, "mode": "rl", "api_url": api_url,
        "vllm_urls": urls, "vllm_supervised": True, "run_dir": run_dir / "trainer"}, place)
    return Layout(api, replicas, envs, trainers, backends, bridge)


def deterministic_vllm_args(max_model_len: int) -> list[str]:
    """vLLM's flags for a deterministic run: whole prefills only. A chunked prefill splits a
    prompt where the step's token budget runs out, which depends on what else is
    scheduled; and vLLM's CPU build crashes (``CPU Generator does not use offset``) when a
    seeded request's prefill is chunked. Without chunking the step budget must hold a
    whole ``max_model_len`` prompt."""
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
            str(max(max_model_len, 2048))]


def trainer_processes(config: RunConfig, name: str, train_yaml: Path,
                      settings: dict[str, Any] | None, place: Placement, *,
                      alone: bool = False) -> list[Process]:
    """``lachesis train --config train_yaml`` on ``train.nproc`` ranks: one process
    (torchrun for several ranks), or with :attr:`Placement.per_rank` one process per rank
    in the places ``trainer-0``, ``trainer-1``, ... (named ``NAME-RANK``), rendezvous at
    rank 0's place. The first process writes ``settings`` into ``train_yaml`` (None: it is
    written already). ``alone``: nothing of the run runs beside it (the warm start), so a
    one-process trainer gets a thread per core (:func:`trainer_threads`)."""
    logs = config.run_dir / "logs"
    nproc, devices = config.train_nproc, config.train_devices
    command = lachesis_command("train", "--config", str(train_yaml))
    if not place.per_rank or nproc == 1:
        if nproc > 1:
            # --standalone: torchrun's rendezvous on a free local port.
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", str(nproc), "-m", "lachesis.cli", "train",
                       "--config", str(train_yaml)]
        return [Process(name, command, logs / f"{name}.log",
                        env={**(trainer_threads(alone) if nproc == 1 else {}),  # (torchrun: 1)
                             **place.device_env("trainer-0", devices)},
                        devices=devices,
                        settings=None if settings is None else (train_yaml, settings),
                        slot="trainer-0")]
    master = {"MASTER_ADDR": place.host("trainer-0"),
              "MASTER_PORT": str(place.rendezvous_port("trainer-0")), "WORLD_SIZE": str(nproc)}
    return [Process(f"{name}-{rank}", command, logs / f"{name}-{rank}.log",
                    env={**master, "RANK": str(rank), **place.rank_env(rank, nproc)},
                    settings=(train_yaml, settings) if rank == 0 and settings is not None
                    else None,
                    slot=f"trainer-{rank}") for rank in range(nproc)]


def trainer_memory_advice(train: dict[str, Any]) -> str:
    """What makes the trainer of the run's ``train`` settings need less memory."""
    from trainer.config import TrainConfig
    from trainer.rehearsal import memory_advice

    fields = TrainConfig.model_fields
    packing, max_tokens, rows = (train.get(k, fields[k].default) for k in (
        "packing", "max_tokens_per_micro_batch", "micro_batch_size"))
    return ("if the trainer was killed for memory, "
            f"{memory_advice(packing, max_tokens, rows)} "
            "(train.rehearse_longest_micro_batch: true tries the longest micro-batch "
            "at the trainer's start)")


def trainer_threads(alone: bool = False) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for a one-process trainer, unless the run's environment sets it:
    half the machine's cores less one, at least 1. vLLM's engine and the env servers run
    beside it; torch's default (a thread per core) made its OpenMP threads wait for each
    other on cores the engine holds: on 2 cores the quickstart's update took 2.2 s with 2
    threads, 0.8 s with 1 (benchmarks/rl_step_time.py, docs/benchmarks-rollout.md). ``alone``
    (the warm start, before anything else of the run starts): a thread per core; on 2
    cores the quickstart's SFT step took 0.10-0.12 s with 2 threads, 0.15 s with 1
    (median of 55 steps, twice each)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return {}
    cores = os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(cores if alone else max(1, cores // 2 - 1))}


def _kind(env: EnvSettings) -> str:
    """``atropos`` for an atroposlib env, else ``lachesis`` (also when the env cannot be
    loaded: the run's checks report that)."""
    try:
        return env_facts(env)["kind"]
    except (ValueError, LookupError, OSError):
        return "lachesis"


def env_backend(env: EnvSettings, logs: Path, place: Placement | None = None) -> Process:
    """The server ``env.server`` says to start (``{port}``: its port, ``{host}``: its
    address, loopback: OpenEnv servers have no authentication, so only the env servers
    beside them reach them; :meth:`Placement.server_place`)."""
    server = env.server
    place = place or Placement()
    name = f"server-{env.label}"
    slot = place.server_place(env.label)
    host, port = LOOPBACK, server.port or place.local_port(slot or name)

    def fill(text: str) -> str:
        return text.replace("{port}", str(port)).replace("{host}", host)

    environment = {k: fill(v) for k, v in server.environment.items()}
    command = [fill(c) for c in server.command or []]
    container = None
    if server.docker_image is not None:
        # --init: the image's server is not PID 1, so the SIGTERM docker passes on stops it
        container = f"lachesis-{env.label}-{port}"
        command = ["docker", "run", "--rm", "--init", "--network", "host",
                   "--name", container, "-e", f"PORT={port}",
                   *[a for k, v in environment.items() for a in ("-e", f"{k}={v}")],
                   server.docker_image, *command]
    url = f"http://{host}:{port}"
    return Process(name, command, logs / f"{name}.log", env=environment, port=port, url=url,
                   health_url=url + server.health_path, container=container, slot=slot)
