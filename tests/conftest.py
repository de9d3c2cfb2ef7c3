"""Shared test helpers: in-process API servers, real server subprocesses, group builders."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from environments.api.schemas import APIConfig
from environments.api.routes import API_KEY, build_app
from environments.trajectory import ScoredGroup, ScoredTrajectory

# One OpenMP thread per process unless the caller says otherwise, set before anything
# imports torch (nothing above does). `make test` runs three sessions side by side on two
# cores and many tests start processes of their own: torch's second intra-op thread then
# mostly spins waiting for a core. Measured on the 2-core machine, beside a suite run, the
# unit tests of test_packing.py and test_losses.py: 42 s of CPU with 2 threads, 7 s with
# 1. The tests check behaviour, not thread counts (test_layout.py sets what its thread
# checks read). vLLM's CPU workers pin their own (one thread on two cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tokenizer classes the session's processes record for the models the tests build
# (environments/inference/tokenizer.py): in a directory of the session's, not the user's
# cache, which would fill with records of deleted temporary models.
_TOKENIZER_CLASSES = tempfile.mkdtemp(prefix="lachesis-tokenizer-classes-")
atexit.register(shutil.rmtree, _TOKENIZER_CLASSES, ignore_errors=True)
os.environ.setdefault("LACHESIS_TOKENIZER_CLASSES", _TOKENIZER_CLASSES)
# gloo's pairs (torchrun's ranks, a Ray run's, vLLM's own groups) on the loopback
# interface: gloo otherwise binds the address the machine's hostname resolves to, which is
# 127.0.0.1 on some machines and a network interface's address on others; the tests talk
# only to 127.0.0.1.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

REPO = Path(__file__).resolve().parent.parent


def make_group(n: int = 2, length: int = 6, *, group_id: str | None = None,
               env_id: int | None = None, policy_version: int | None = None,
               turn_scores: bool = False, seed: int = 0) -> ScoredGroup:
    """A small valid group: prompt of 2 tokens, the rest sampled."""
    trajectories = []
    for i in range(n):
        tokens = [(seed * 31 + i * 7 + j) % 250 + 1 for j in range(length)]
        masks = [-100, -100] + tokens[2:]
        logprobs = [1.0, 1.0] + [-0.5] * (length - 2)
        extra = {}
        if turn_scores:
            extra = {"scores": [0.5, float(i)], "turn_spans": [[2, 4], [4, length]]}
        trajectories.append(ScoredTrajectory(
            tokens=tokens, masks=masks, inference_logprobs=logprobs,
            scores=extra.pop("scores", float(i)), policy_version=policy_version, **extra))
    kwargs = {"group_id": group_id} if group_id else {}
    return ScoredGroup(trajectories=trajectories, env_id=env_id, **kwargs)


@contextlib.asynccontextmanager
async def running_api(**settings):
    """An in-process rollout API (real aiohttp server on a free port)."""
    settings.setdefault("in_memory", True)
    server = TestServer(build_app(APIConfig(**settings)), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), server.app[API_KEY]
    finally:
        await server.close()


def load_script(relative: str):
    """A script of the repository (``benchmarks/x.py``, ``experiments/y.py``) as a module."""
    import importlib.util

    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_check(model_dir, data, run_dir, batch_size: int) -> subprocess.CompletedProcess:
    """``lachesis train --check`` on the groups in ``data``: the trainer recomputes every
    sampled token's logprob and prints the alignment summary (JSON) on stdout."""
    return subprocess.run(
        [sys.executable, "-m", "lachesis.cli", "train", "--check", "--model", str(model_dir),
         "--data", str(data), "--batch-size", str(batch_size), "--run-dir", str(run_dir),
         "--tensorboard", "false", "--log-level", "WARNING"],
        cwd=REPO, capture_output=True, text=True, timeout=300)


def run(coro):
    return asyncio.run(coro)


def free_port() -> int:
    """A port for a server a test starts: below the ephemeral range, where no outgoing
    connection can take it before the server binds it (vllm_process.free_port)."""
    from environments.inference.vllm_process import free_port as pick

    return pick()


class APIProcess:
    """`lachesis api` as a real subprocess, for crash and restart tests."""

    def __init__(self, *args: str, port: int | None = None):
        self.port = port or free_port()
        self.args = args
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> APIProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lachesis.cli", "api", "--port", str(self.port),
             *self.args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"API exited: {self.proc.stdout.read().decode()}")
            try:
                urllib.request.urlopen(self.url + "/", timeout=1)
                return self
            except OSError as error:
                if getattr(error, "code", None) == 401:  # up, and wants a token
                    return self
                time.sleep(0.1)
        raise RuntimeError("API did not come up")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


@pytest.fixture
def api_process():
    started: list[APIProcess] = []

    def factory(*args: str, port: int | None = None) -> APIProcess:
        p = APIProcess(*args, port=port)
        started.append(p)
        return p.start()

    yield factory
    for p in started:
        p.kill()
from vllm_fixture import (  # noqa: E402,F401  (each vLLM server once per test session)
    VLLM_FIXTURES,
    session_servers,
    tiny_model_dir,
    transfer_vllm_server,
    vllm_server,
)


def pytest_collection_modifyitems(config, items):
    """Mark the tests that start real heavy components, so ``pytest -m unit`` (or
    ``make test-fast``) runs the rest in about a minute: ``vllm`` (a vLLM CPU server),
    ``docker`` (the docker daemon and an image), ``chromium`` (headless Chromium), ``ray``
    (a local Ray cluster), and ``system`` for the heavy tests that start a whole system of
    their own (see below). The
    markers come from the fixtures and parameters a test uses, so a new test is marked
    without anyone remembering to."""
    import pytest as _pytest

    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        params = {str(v) for v in callspec.params.values()} if callspec else set()
        heavy = set()
        if names & VLLM_FIXTURES or item.get_closest_marker("vllm"):
            heavy.add("vllm")
        if "docker_image" in names or "docker" in params or item.get_closest_marker("docker"):
            heavy.add("docker")
        if "chromium" in item.name or item.get_closest_marker("chromium"):
            heavy.add("chromium")
        if item.get_closest_marker("ray"):
            heavy.add("ray")
        for mark in heavy:
            item.add_marker(getattr(_pytest.mark, mark))
        if not heavy:
            item.add_marker(_pytest.mark.unit)
        elif heavy <= {"vllm", "ray"} and "vllm_server" not in names:
            # a whole system of its own (a `lachesis run`, vLLM servers of its own, a Ray
            # cluster), or the session's transfer server alone (weight transfers, LoRA
            # hot-loads: the session that runs them starts it): shares neither the
            # session's main vLLM server, docker nor Chromium, so `make test` runs these in
            # sessions beside the others (the Ray tests beside the unit tests, which end
            # first). Measured on 7 Dec 2026: the other heavy tests' session ended last,
            # 365 s after this one; the transfer server's tests were 137 s of it.
            item.add_marker(_pytest.mark.system)


def pytest_configure(config):
    import cpu_cost
    import system_packages

    cpu_cost.register(config)
    system_packages.register(config)
