"""The settings of ``lachesis run CONFIG``: one YAML file for the whole system.

Each section is checked against the settings model of the process it configures (the
rollout API's ``APIConfig``, the env's ``config_class``, ``TrainConfig``), so a wrong key
is reported before anything starts. The supervisor fills in what ties the processes
together (ports, URLs, the model the warm start produced, paths under ``runs/NAME/``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from environments.settings import load_settings

# Keys the supervisor sets itself; a config that sets them would be silently overridden.
_WIRED = {
    "api": {"host", "port", "db"},
    "env": {"api_url", "inference_servers", "tokenizer", "jsonl_out", "spool_path",
            "eval_out", "total_groups", "env_weight"},
    "train": {"model", "tokenizer", "mode", "api_url", "data", "vllm_urls", "vllm_launch",
              "vllm_supervised", "run_dir", "resume"},
}
TRAIN_LAYOUT = {"nproc", "devices"}
"""Keys of ``train`` that place the trainer (not ``TrainConfig`` keys)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class VLLMSettings(_Section):
    replicas: int = Field(default=1, ge=1)
    """vLLM servers of the policy: every weight sync reaches each, every env server spreads
    its requests over them (least in flight), and one that dies is restarted while the
    run goes on."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per replica (vLLM's ``--tensor-parallel-size``)."""
    devices: list[int] | list[list[int]] | None = None
    """GPUs of the replicas (each replica's CUDA_VISIBLE_DEVICES): one list per replica,
    or one flat list cut in order into ``tensor_parallel_size`` devices per replica.
    None: no placement (vLLM sees what the run sees)."""
    max_restarts: int = Field(default=3, ge=0)
    """How often one replica may be restarted before the run stops."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """The first replica's port (replica i: port + i); None: free ports."""
    max_model_len: int = Field(default=4096, ge=16)
    dtype: str = "float32"
    """vLLM's ``--dtype``; ``auto``: bfloat16 on GPUs and on CPUs with AMX-BF16 or
    AVX512-BF16, float32 on other CPUs (environments/inference/dtypes.py)."""
    kv_cache_gib: int = Field(default=2, ge=1)
    """KV cache of the CPU build (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    args: list[str] = Field(default_factory=list)
    """Extra arguments for the vLLM server."""
    environment: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the vLLM servers (e.g. ``OMP_NUM_THREADS``, ``VLLM_*``
    settings), on top of the run's own."""
    access_log: bool = False
    """A line per HTTP request in the replica's log (uvicorn's access log). Off: every
    turn of every rollout is a request, and those lines would be nearly all of the log."""
    startup_timeout_s: float = Field(default=600.0, gt=0)


class EnvServerSettings(_Section):
    """A server an env talks to that the run starts, health-checks and stops itself (an
    OpenEnv server): from a command, or a docker image run with the host's network.
    ``{port}`` in its command, and in the env's name, is the server's port."""

    command: list[str] | None = None
    """The command, e.g. ``[.venv-openenv/bin/python, -m, uvicorn, my_server:app, --port,
    "{port}"]``; with ``docker_image``: the container's command (default: the image's)."""
    docker_image: str | None = None
    """Run this image (``docker run --rm --network host``; its server must listen on
    ``{port}``, given to it as ``PORT``)."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """None: a free port."""
    health_path: str = "/health"
    """The server is up once ``GET http://127.0.0.1:{port}{health_path}`` answers."""
    environment: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the server (``{port}`` is replaced)."""
    startup_timeout_s: float = Field(default=120.0, gt=0)

    @model_validator(mode="after")
    def _one_way_to_start(self) -> EnvServerSettings:
        if self.command is None and self.docker_image is None:
            raise ValueError("give the server's command or its docker_image")
        return self


class EnvSettings(_Section):
    name: str
    """Registered env name, ``file.py:Class``, ``module:Class``, ``KIND:SPEC`` (e.g.
    ``verifiers:ID``, ``openenv:URL``), or an atroposlib ``BaseEnv`` subclass as
    ``module:Class`` or ``file.py:Class``."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Keys of the env's config class (an atroposlib env: ``env:`` and ``openai:``, its
    ``--env.*`` and ``--openai.*`` flags)."""
    python: str | None = None
    """The Python interpreter of this env's processes, e.g. a venv with the env's own
    dependencies (``.venv-verifiers/bin/python`` for ``verifiers:ID``); Lachesis's code is
    put on its PYTHONPATH. None: the run's own."""
    environment: dict[str, str] = Field(default_factory=dict)
    """Environment variables of this env's processes (a PYTHONPATH goes in front of
    Lachesis's code)."""
    server: EnvServerSettings | None = None
    """A server of the env's (an OpenEnv server) that the run starts before the env and
    stops at the end."""
    count: int = Field(default=1, ge=1)
    """Env servers of this env (each its own process, trajectory file and spool)."""
    weight: float = Field(default=1.0, gt=0)
    """Its weight in the API's mix of groups, split evenly over its ``count`` servers
    (each server's ``env_weight``)."""

    @property
    def label(self) -> str:
        """The env's name as a file and process name (``openenv:http://h:1`` ->
        ``openenv_http_h_1``, ``path/to/envs.py:MyEnv`` -> ``envs.py_MyEnv``); the
        ``{port}`` and ``{host}`` placeholders of a server the run starts are left out
        (``openenv:http://127.0.0.1:{port}`` -> ``openenv_http_127.0.0.1``), so the
        label does not change when the port does."""
        name = self.name.replace("{port}", "").replace("{host}", "host")
        where, _, cls = name.rpartition(":")
        name = f"{Path(where).name}:{cls}" if where.endswith(".py") else name
        return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


class WarmStartSettings(_Section):
    env: str
    """The env whose ``oracle_messages(item)`` gives the demonstrations."""
    demonstrations: int = Field(default=512, ge=1)
    settings: dict[str, Any] = Field(default_factory=dict)
    """Env settings for drawing the demonstration items (difficulty, seed)."""
    train: dict[str, Any] = Field(default_factory=dict)
    """``TrainConfig`` keys for the SFT phase (mode is sft)."""


class RaySettings(_Section):
    """Where the processes go on a Ray cluster (``lachesis run CONFIG --ray ADDRESS``;
    ignored without ``--ray``). docs/multi-node.md."""

    nodes: dict[str, str] = Field(default_factory=dict)
    """Process -> a Ray resource that only the wanted node(s) have: a custom one (``ray
    start --resources '{"envs": 1}'``) or Ray's own ``node:IP``. Keys are process names
    or globs (``api``, ``env-*``, ``vllm-1``); ``trainer`` and ``vllm`` name all the
    trainer's ranks and all replicas. A process not named goes where Ray puts it."""
    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """The placement-group strategy of the trainer's ranks (a bundle per rank: one GPU,
    or one CPU on a cluster without GPUs). ``PACK``: as few nodes as possible."""


class HangTimeouts(_Section):
    """Seconds a process of each kind may go without answering (its health endpoint) or
    beating (its heartbeat) before the supervisor names it, kills it (SIGKILL) and
    restarts it like a dead one (docs/fault-tolerance.md). None: not checked. Before its
    first answer after a (re)start a process has its start-up timeout instead
    (``startup_timeout_s``, ``vllm.startup_timeout_s``, the env server's)."""

    api: float | None = Field(default=60.0, gt=0)
    """The rollout API: it answers ``/health`` from its event loop; its database writes
    run in a thread, so only a frozen or blocked loop misses this."""
    vllm: float | None = Field(default=300.0, gt=0)
    """A vLLM replica, once up: its API server's ``/health`` and the heartbeats of its
    API server and engine core (a weight reload of a big model keeps both going)."""
    env: float | None = Field(default=60.0, gt=0)
    """An env server: beats from its event loop (a tool call that blocks the loop this
    long is a hang)."""
    trainer: float | None = Field(default=600.0, gt=0)
    """The trainer's ranks: each beats from a thread, through steps, syncs and
    checkpoints; a call that holds Python's GIL that long (a checkpoint of a very big
    model written by one call) would count as a hang."""
    server: float | None = Field(default=60.0, gt=0)
    """A server the run starts for an env (OpenEnv), and the Atropos bridge: their
    health endpoints."""


class LivenessSettings(_Section):
    """How the supervisor tells a hung process from a busy one (lachesis/run/liveness.py)."""

    check_every_s: float = Field(default=5.0, gt=0)
    """How often every process is checked: a permanent freeze is named within its
    ``hang_timeout_s`` plus this plus ``health_timeout_s`` (the health check that finds
    it silent waits that long)."""
    health_timeout_s: float = Field(default=5.0, gt=0)
    """How long one health check may take (a miss alone is not a hang: the bound is
    ``hang_timeout_s``)."""
    heartbeat_period_s: float = Field(default=1.0, gt=0)
    """How often the processes that beat write their heartbeat."""
    hang_timeout_s: HangTimeouts = Field(default_factory=HangTimeouts)
    setup_timeout_s: float | None = Field(default=3600.0, gt=0)
    """The longest an env server may take to start while it beats (connecting to
    inference, then its ``setup()``: games made, a dataset read). Its start beats from a
    thread, so a ``setup()`` waiting for ever in a call that lets go of Python's GIL (a
    socket, a lock, a subprocess) beats on; past this it is named, killed and restarted
    like a hung one. None: not bounded."""

    @model_validator(mode="after")
    def _beats_fit(self) -> LivenessSettings:
        for kind, bound in self.hang_timeout_s.model_dump().items():
            if bound is not None and bound <= 2 * self.heartbeat_period_s:
                raise ValueError(f"hang_timeout_s.{kind} {bound:g} s is not more than two "
                                 f"heartbeat periods ({self.heartbeat_period_s:g} s each): "
                                 "every process would look hung")
        return self


class RunConfig(_Section):
    name: str
    """The run writes everything under ``runs_dir/name``."""
    runs_dir: Path = Path("runs")
    model: str
    """The policy: an HF model directory or name (the warm start trains from it)."""
    build_tiny_model: bool | dict[str, Any] = False
    """Build ``model`` with ``make-tiny-model`` when the directory does not exist: true, or
    the builder's settings (e.g. ``{tokenizer: arithmetic, num_layers: 2}``, see
    ``lachesis.tiny_model.make_tiny_model``)."""
    warm_start: WarmStartSettings | None = None
    """SFT on env demonstrations before RL (skipped when its result exists)."""
    api: dict[str, Any] = Field(default_factory=dict)
    """``APIConfig`` keys."""
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    envs: list[EnvSettings] = Field(min_length=1)
    """One env server per entry."""
    train: dict[str, Any] = Field(default_factory=dict)
    """``TrainConfig`` keys for the RL phase."""
    lora: dict[str, Any] | None = None
    """Train a LoRA adapter in the RL phase (``TrainConfig.lora``: rank, alpha, dropout,
    target_modules): vLLM starts with runtime adapter loading, each new adapter version is
    hot-loaded and the envs switch to it."""
    evaluate: bool = True
    """Evaluate every env before and after RL (its ``eval_items``, greedy by default)."""
    evaluate_before: bool = True
    """With ``evaluate``: also before RL (off when the starting policy was measured already)."""
    startup_timeout_s: float = Field(default=120.0, gt=0)
    """How long the rollout API and env servers may take to come up."""
    max_restarts: int = Field(default=3, ge=0)
    """How often each process of the RL phase (the rollout API, an env server, a server
    the run starts for an env, the trainer) may be restarted after it dies before the run
    stops (vLLM replicas: ``vllm.max_restarts``). docs/fault-tolerance.md."""
    liveness: LivenessSettings = Field(default_factory=LivenessSettings)
    """How a process that is alive but answers nothing is found and restarted."""
    restart_backoff_s: float = Field(default=1.0, ge=0)
    """Wait before a restart: this, doubled with each restart of the same process
    (at most 30 s)."""
    ray: RaySettings = Field(default_factory=RaySettings)
    """Placement on a Ray cluster, used by ``lachesis run CONFIG --ray ADDRESS``."""
    shared_devices: list[int] = Field(default_factory=list)
    """GPUs that may be given to more than one process on purpose (e.g. a small model's
    vLLM replica beside a trainer rank); any other device given twice is an error."""
    deterministic: bool = False
    """Synchronous, seeded RL (docs/determinism.md): the env seeds every sampling request
    (``seeded_sampling``) and works in lockstep with the trainer
    (``groups_per_policy_version``: the groups of one trainer sync), so what the trainer
    gets does not depend on timing, and the trainer uses deterministic kernels
    (``train.deterministic``). One env server of a Lachesis env; no dynamic sampling.
    Generation waits for each weight update (no overlap with training)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"{name!r}: use letters, digits, '.', '_' and '-' only")
        return name

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.name

    @property
    def rl_train(self) -> dict[str, Any]:
        """The RL phase's ``TrainConfig`` keys, with the ``lora`` section."""
        train = {k: v for k, v in self.train.items() if k not in TRAIN_LAYOUT}
        return {**train, **({"lora": self.lora} if self.lora is not None else {})}

    @property
    def train_nproc(self) -> int:
        """The trainer's processes (``train.nproc``; more than one: under torchrun)."""
        return self.train.get("nproc", 1)

    @property
    def train_devices(self) -> list[int] | None:
        """The trainer's GPUs (``train.devices``), one per process."""
        return self.train.get("devices")

    @property
    def replica_devices(self) -> list[list[int] | None]:
        """Each vLLM replica's devices (None: no placement)."""
        v = self.vllm
        if v.devices is None:
            return [None] * v.replicas
        if all(isinstance(d, int) for d in v.devices):
            tp = v.tensor_parallel_size
            return [list(v.devices[i * tp:(i + 1) * tp]) for i in range(v.replicas)]
        return [list(d) for d in v.devices]

    def check_layout(self) -> None:
        """Devices and process counts that can work together (raises ValueError saying
        what to change). Whether the devices exist is checked by the plan."""
        v, tp = self.vllm, self.vllm.tensor_parallel_size
        nproc, devices = self.train.get("nproc", 1), self.train.get("devices")
        if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
            raise ValueError(f"train.nproc: {nproc!r} is not a process count (an integer >= 1)")
        if devices is not None:
            if not (isinstance(devices, list)
                    and all(isinstance(d, int) and d >= 0 for d in devices)):
                raise ValueError(f"train.devices: {devices!r} is not a list of GPU indices")
            if len(devices) != nproc:
                raise ValueError(f"train.devices: {len(devices)} devices for train.nproc "
                                 f"{nproc} processes: give one device per process")
        if v.devices is not None:
            flat = all(isinstance(d, int) for d in v.devices)
            if flat and len(v.devices) != v.replicas * tp:
                raise ValueError(
                    f"vllm.devices: {len(v.devices)} devices for {v.replicas} replica(s) of "
                    f"tensor_parallel_size {tp}: give {v.replicas * tp}")
            if not flat and len(v.devices) != v.replicas:
                raise ValueError(f"vllm.devices: {len(v.devices)} lists for {v.replicas} "
                                 "replica(s): give one list per replica")
            for i, replica in enumerate(self.replica_devices):
                if len(replica) != tp:
                    raise ValueError(f"vllm.devices[{i}]: {len(replica)} devices for "
                                     f"tensor_parallel_size {tp}")
                if any(d < 0 for d in replica):
                    raise ValueError(f"vllm.devices[{i}]: {replica} has a negative index")
        owners: dict[int, list[str]] = {}
        for i, replica in enumerate(self.replica_devices):
            for d in replica or []:
                owners.setdefault(d, []).append(f"vllm-{i}")
        for rank, d in enumerate(devices or []):
            owners.setdefault(d, []).append(f"trainer rank {rank}")
        for d, names in sorted(owners.items()):
            if len(names) > 1 and d not in self.shared_devices:
                raise ValueError(
                    f"device {d} is given to {' and '.join(names)}: give each process its "
                    "own devices, or list it in shared_devices to share it on purpose")

    @classmethod
    def load(cls, path: str | Path, *, check: bool = True, **overrides: Any) -> RunConfig:
        """The run config of ``path`` (``check``: with every section checked, see
        :meth:`check_sections`)."""
        config = load_settings(cls, path, None, overrides)
        if check:
            config.check_sections()
        return config

    def check_sections(self) -> None:
        """Validate every section against its process's settings model (raises ValueError
        naming the section and the key)."""
        from environments.api.schemas import APIConfig
        from trainer.config import TrainConfig

        def check(where: str, kind: str, settings: type[BaseModel], values: dict[str, Any],
                  **fill: Any) -> None:
            wired = sorted(set(values) & _WIRED[kind])
            if wired:
                raise ValueError(f"{where}: {', '.join(wired)} are set by `lachesis run` "
                                 "itself; remove them")
            try:
                settings.model_validate({**fill, **values})
            except ValidationError as error:
                raise ValueError(f"{where}: {error}") from None

        self.check_layout()
        check("api", "api", APIConfig, self.api)
        for i, env in enumerate(self.envs):
            wired = sorted(set(env.settings) & _WIRED["env"])
            if wired:
                raise ValueError(f"envs[{i}] ({env.name}).settings: {', '.join(wired)} are "
                                 "set by `lachesis run` itself; remove them")
            try:
                env_facts(env)
            except (ValidationError, ValueError) as error:
                raise ValueError(f"envs[{i}] ({env.name}).settings: {error}") from None
        if self.lora is not None and "lora" in self.train:
            raise ValueError("lora: set it at the top level or under train, not both")
        check("train", "train", TrainConfig, self.rl_train, model=self.model)
        problems = batch_problems(self) + self.determinism_problems()
        if problems:
            raise ValueError(problems[0])
        if self.warm_start is not None:
            from lachesis.env_kinds import load_env_class

            env_class = load_env_class(self.warm_start.env)
            if not hasattr(env_class, "oracle_messages"):
                raise ValueError(f"warm_start.env: {self.warm_start.env} has no "
                                 "oracle_messages(item) to make demonstrations with")
            check("warm_start.settings", "env", env_class.config_class,
                  self.warm_start.settings)
            problem = getattr(env_class, "demonstrator_problem", None)
            problem = problem and problem(env_class.config_class(**self.warm_start.settings))
            if problem:
                raise ValueError(f"warm_start.env: {self.warm_start.env} cannot make "
                                 f"demonstrations: {problem}")
            check("warm_start.train", "train", TrainConfig, self.warm_start.train,
                  model=self.model)

    def groups_per_batch(self, env: EnvSettings) -> int:
        """How many of ``env``'s groups one training batch holds: what ``lachesis run``
        lets each env server queue ahead of the trainer (its ``max_queued_groups``)
        unless the env's settings say otherwise."""
        from trainer.config import TrainConfig

        train = TrainConfig.model_validate({"model": self.model, **self.rl_train})
        return max(1, train.batch_size // env_facts(env)["group_size"])

    def lockstep_groups(self) -> int:
        """Groups per policy version in a ``deterministic`` run: one trainer sync's."""
        from trainer.config import TrainConfig

        train = TrainConfig.model_validate({"model": self.model, **self.rl_train})
        return train.batch_size * train.sync_every // env_facts(self.envs[0])["group_size"]

    def determinism_problems(self) -> list[str]:
        """What keeps a ``deterministic`` run from being one (empty when it is not asked)."""
        if not self.deterministic:
            return []
        env = self.envs[0]
        if len(self.envs) > 1 or env.count > 1:
            return ["deterministic: give one env server (one entry in envs, count 1); the "
                    "API's mix of several envs' groups depends on timing"]
        if env_facts(env)["kind"] != "lachesis":
            return [f"deterministic: envs[0] ({env.name}) is an atroposlib env, which "
                    "samples through its own client; only Lachesis envs seed their requests"]
        if self.train.get("dynamic_sampling"):
            return ["deterministic: train.dynamic_sampling asks for groups beyond each "
                    "batch, which lockstep does not make; turn one of them off"]
        if self.train.get("deterministic") is False:
            return ["deterministic: train.deterministic is false, but a deterministic run "
                    "needs the trainer's deterministic kernels; remove it"]
        fixed = {"seeded_sampling": True, "groups_per_policy_version": self.lockstep_groups()}
        for key, value in fixed.items():
            if key in env.settings and env.settings[key] != value:
                return [f"envs[0] ({env.name}).settings: {key} is {env.settings[key]!r}, "
                        f"but deterministic sets it to {value!r}; remove it"]
        return []


_FACTS: dict[str, dict[str, Any]] = {}


def env_facts(env: EnvSettings) -> dict[str, Any]:
    """:func:`lachesis.env_kinds.env_facts` of ``env``, asked of the env's own interpreter
    when it has one (``python``). Raises ValueError or LookupError saying what is wrong."""
    import json
    import os
    import subprocess

    key = json.dumps([env.name, env.settings, env.python, env.environment], sort_keys=True,
                     default=str)
    if key in _FACTS:
        return _FACTS[key]
    if env.python is None:
        from lachesis.env_kinds import env_facts as facts

        _FACTS[key] = facts(env.name, env.settings)
        return _FACTS[key]
    try:
        done = subprocess.run(
            [env.python, "-m", "lachesis.env_kinds", env.name, json.dumps(env.settings)],
            env=env_process_environment(env, os.environ), capture_output=True, text=True,
            timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"cannot run the env's python {env.python}: {error}") from None
    if done.returncode != 0:
        error = LookupError if done.returncode == 3 else ValueError
        raise error(f"(checked with {env.python}) {done.stderr.strip()[-2000:] or 'no output'}")
    _FACTS[key] = json.loads(done.stdout)
    return _FACTS[key]


def env_process_environment(env: EnvSettings, base: dict[str, str]) -> dict[str, str]:
    """The environment variables of ``env``'s processes on top of ``base``: its own, and
    Lachesis's code on the PYTHONPATH when it runs in another interpreter."""
    import os

    import lachesis

    values = dict(env.environment)
    if env.python is not None:
        code = str(Path(lachesis.__file__).resolve().parent.parent)
        values["PYTHONPATH"] = os.pathsep.join(
            p for p in (values.get("PYTHONPATH"), code) if p)
    return {**base, **values}


def batch_problems(config: RunConfig) -> list[str]:
    """Each env whose group size does not divide the trainer's batch (batches hold whole
    groups)."""
    from trainer.config import TrainConfig

    batch_size = TrainConfig.model_validate({"model": config.model,
                                             **config.rl_train}).batch_size
    problems = []
    for i, env in enumerate(config.envs):
        group_size = env_facts(env)["group_size"]
        if batch_size % group_size:
            problems.append(
                f"envs[{i}] ({env.name}).settings: group_size {group_size} does not divide "
                f"train.batch_size {batch_size}; batches hold whole groups, so every "
                f"batch would have {batch_size - batch_size % group_size} sequences")
    return problems


def write_yaml(path: Path, values: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_plain(values), sort_keys=False))
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
