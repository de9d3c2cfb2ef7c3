"""A vLLM OpenAI-compatible server as a managed subprocess (CPU-friendly defaults).

    with VLLMProcess(model_dir, max_model_len=4096) as server:
        requests.post(server.url + "/v1/completions", json={...})

The server is vLLM's `vllm.entrypoints.openai.api_server` (the `vllm` console script has
no distribution metadata in the CPU build), started as `python -m
environments.inference.vllm_serve`, which forks its engine core on a CPU instead of
spawning it (seconds of imports less a start), in its own process group, so `stop()` also
ends the engine-core child process.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from environments.inference.vllm_auth import middleware_args
from environments.settings import TOKEN_VARIABLE


SERVE_MODULE = "environments.inference.vllm_serve"
"""What a server's command runs: vLLM's OpenAI API server (same arguments)."""


class VLLMProcessError(RuntimeError):
    """The server exited or did not become healthy in time."""


_HANDED_OUT: set[int] = set()
PORTS_BELOW_EPHEMERAL = (20000, 32768)
"""Where :func:`free_port` picks: above Ray's worker ports (10002-19999), below Linux's
ephemeral range (``ip_local_port_range``, 32768-60999 by default)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PORTS_BELOW_EPHEMERAL[1]


_PICK = random.SystemRandom()
"""Ports are drawn from the OS's randomness, not the global ``random`` that a trainer seeds
(``random.seed(config.seed)``): two processes seeded alike would pick the same ports."""


def _pick_port(host: str, reuse: bool) -> socket.socket | None:
    """A socket bound to a random port below the kernel's ephemeral range that this process
    has not handed out before (None where that range is too small)."""
    low, high = PORTS_BELOW_EPHEMERAL[0], min(PORTS_BELOW_EPHEMERAL[1], _ephemeral_low())
    for _ in range(100 if high - low >= 1000 else 0):
        port = _PICK.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        s = socket.socket()
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            continue
        _HANDED_OUT.add(port)
        return s
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process that binds it later. Picked at random below the
    kernel's ephemeral range, where it can't be taken in between by another program's
    outgoing connection or port-0 bind (those use only that range), and never twice in
    this process; falls back to a port-0 bind where that range is too small."""
    s = _pick_port(host, reuse=False)
    if s is None:
        s = socket.socket()
        s.bind((host, 0))
    with s:
        return s.getsockname()[1]


_HELD: list[socket.socket] = []


def hold_port() -> int:
    """A port kept for a process that binds it later with ``SO_REUSEADDR`` (torch's
    TCPStore, the rendezvous of a trainer's ranks): this process keeps a socket bound to it
    on every address, not listening, for as long as it runs. No other bind without
    ``SO_REUSEADDR`` and no port-0 pick can take the port in the meantime, as they can a
    port that :func:`free_port` only found free; the rendezvous binds and listens beside the
    held socket."""
    s = _pick_port("0.0.0.0", reuse=True)
    if s is None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", 0))
    _HELD.append(s)
    return s.getsockname()[1]


def signal_process_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> int | None:
    """Stop a process started with ``start_new_session`` (its pgid is its pid) and every
    process of its group: SIGTERM, then after ``grace_s`` SIGKILL for what is left.
    Returns its exit code."""
    if proc.poll() is None:
        signal_process_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    signal_process_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    return proc.returncode


class VLLMProcess:
    """Start, health-check and stop one vLLM API server."""

    def __init__(self, model_dir: str | os.PathLike, *, port: int | None = None,
                 host: str = "127.0.0.1", max_model_len: int = 4096,
                 served_model_name: str | None = None, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = True,
                 kv_cache_space_gib: int | None = 1, dev_mode: bool = False,
                 extra_args: list[str] | tuple[str, ...] = (),
                 env: dict[str, str] | None = None, log_path: str | os.PathLike | None = None,
                 python: str | None = None, token: str | None = None, guarded: bool = False,
                 access_log: bool = False):
        """``token``: the server refuses every request but ``/health`` without it
        (:mod:`environments.inference.vllm_auth`; it reaches the server in its environment,
        never on its command line). ``guarded``: the same, with the token taken from the
        environment the command is started in (``LACHESIS_API_TOKEN``). ``access_log``:
        uvicorn's line per HTTP request in the log (off: an RL run sends hundreds of
        requests a step, and the log would hold little else)."""
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port or free_port(host)
        self.max_model_len = max_model_len
        self.model_name = served_model_name or self.model_dir.name
        self.dtype = dtype
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.kv_cache_space_gib = kv_cache_space_gib
        self.dev_mode = dev_mode
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.python = python or sys.executable
        self.token = token
        self.guarded = guarded or token is not None
        self.access_log = access_log
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", SERVE_MODULE,
               "--model", str(self.model_dir), "--host", self.host, "--port", str(self.port),
               "--dtype", self.dtype,
               "--gpu-memory-utilization", str(self.gpu_memory_utilization),
               "--max-model-len", str(self.max_model_len),
               "--served-model-name", self.model_name]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if "--enable-scale-out" not in self.extra_args:
            # /inference/v1/generate: token-in/token-out that says which weight version
            # sampled each token (environments/inference/vllm_client.py)
            cmd.append("--enable-scale-out")
        if not self.access_log:
            cmd.append("--disable-uvicorn-access-log")
        if self.guarded:
            cmd += middleware_args()
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.kv_cache_space_gib is not None:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_space_gib))
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        # One process less to start (seconds of imports on a CPU): vLLM's CPU platform runs
        # a single worker inside the engine core process instead of spawning one (it keeps
        # the multiprocess executor only while this is 1; GPU and tensor-parallel servers
        # are not affected, and the API server keeps its engine core process either way).
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(self.extra_env)
        if self.token is not None:
            env[TOKEN_VARIABLE] = self.token
        return env

    def start(self) -> VLLMProcess:
        if self.running:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command(), env=self.environment(), stdin=subprocess.DEVNULL,
            stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_chars:].decode("utf-8", "replace")

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout: float = 300.0, poll: float = 0.5) -> VLLMProcess:
        if self.proc is None:
            raise VLLMProcessError("VLLMProcess.wait_ready() before start()")
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise VLLMProcessError(
                    f"vLLM server exited with code {code} before becoming healthy "
                    f"(log: {self.log_path}):\n{self.log_tail()}")
            if self.healthy():
                return self
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise VLLMProcessError(
                    f"vLLM server at {self.url} not healthy after {timeout:.0f}s "
                    f"(log: {self.log_path}):\n{tail}")
            time.sleep(poll)

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds. Returns the exit code."""
        proc, self.proc = self.proc, None
        # Children (the engine core) may outlive the API server: the whole group goes.
        code = stop_process_group(proc, grace) if proc is not None else None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def __enter__(self) -> VLLMProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VLLMProcess({str(self.model_dir)!r}, url={self.url!r}, running={self.running})"
