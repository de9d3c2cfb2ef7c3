"""Full weights into running vLLM servers in memory, through vLLM's weight-transfer API.

Per server, once: a trainer engine from vLLM's ``WeightTransferTrainerFactory`` makes the
handshake over HTTP (``/init_weight_transfer_engine``, vLLM's ``HTTPVLLMWeightSyncClient``) and sets up the
backend: ``nccl`` on GPU (vLLM's own engine: a process group with the server's workers);
on CPU ``shm`` (a shared-memory file, same machine) or ``gloo`` (a process group over
TCP), both from :mod:`environments.inference.weight_transfer`, a vLLM plugin. Per sync:
``POST /pause?mode=wait`` (running requests finish, new ones wait), the engine's
``send_weights`` (``/start_weight_update``, ``/update_weights`` while the tensors stream
through the group, ``/finish_weight_update``), ``POST /resume``.

The servers must be started with ``--weight-transfer-config '{"backend": ...}'``
(:func:`vllm_options`). A server that refuses the handshake (started without it) is
synced from disk instead when the method is ``auto``. A transfer that fails midway
leaves the paused server with part of the new weights; it is then reloaded from a disk
copy before it resumes, and a server that cannot be reloaded is never resumed.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any
from urllib.parse import urlsplit

import torch

from environments.inference.vllm_plugin import BACKENDS, plugin_pythonpath
from environments.settings import bearer_headers, run_token

log = logging.getLogger(__name__)


def transfer_backend(name: str = "auto") -> str:
    """``auto``: vLLM's ``nccl`` where there is a GPU, else ``shm`` (a shared-memory file:
    the servers run on the trainer's machine; ``gloo`` reaches other machines)."""
    if name != "auto":
        return name
    return "nccl" if torch.cuda.is_available() else "shm"


def vllm_options(backend: str) -> tuple[list[str], dict[str, str]]:
    """Command-line arguments and environment for a vLLM server that accepts weight
    transfers over ``backend``; the gloo plugin is put on its path when the installed
    package does not declare it."""
    env = {}
    if backend in BACKENDS and (path := plugin_pythonpath()) is not None:
        import os

        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH"))
                                            if p)
    return ["--weight-transfer-config", json.dumps({"backend": backend})], env


def _address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host (where vLLM's workers can
    reach the group the trainer hosts)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


class TransferRefused(RuntimeError):
    """The handshake failed: the server was started without a transfer config (or with
    another backend), or cannot reach the trainer's end (``shm``: another machine)."""


def weight_sync_client() -> type:
    """vLLM's ``HTTPVLLMWeightSyncClient``, sending the run's token with every request."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class TokenWeightSyncClient(HTTPVLLMWeightSyncClient):
        def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
            response = requests.post(f"{self.base_url}/{path}", json=json,
                                     timeout=self.timeout, headers=bearer_headers(run_token()))
            response.raise_for_status()

    return TokenWeightSyncClient


class ServerTransfer:
    """The trainer's end of one server's weight-transfer group."""

    def __init__(self, url: str, backend: str, *, timeout_s: float = 300.0):
        self.url = url.rstrip("/")
        self.backend = backend
        self.timeout_s = timeout_s
        self.engine: Any = None

    def connect(self, weights: dict[str, torch.Tensor]) -> None:
        """The handshake (blocking); raises :class:`TransferRefused` when it fails."""
        import requests
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from environments.inference import weight_transfer as gloo
        from environments.inference.vllm_process import free_port

        gloo.register()
        if self.backend == "shm":
            info = gloo.ShmTrainerInitInfo(rank=0)
        elif self.backend == "gloo":
            address = _address_towards(self.url)
            info = gloo.GlooTrainerInitInfo(address, free_port(address), world_size=2,
                                            rank=0, timeout_s=self.timeout_s)
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            address = _address_towards(self.url)
            info = NCCLTrainerInitInfo(address, free_port(address), world_size=2, rank=0)
        client = weight_sync_client()(self.url, timeout=self.timeout_s)
        try:
            self.engine = WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=gloo.StateDictSource(weights))
        except Exception as error:  # noqa: BLE001 - vLLM answers a bare 500 when unconfigured
            text = ""
            if isinstance(error, requests.HTTPError) and error.response is not None:
                text = f": {error.response.text[:300]}"
            raise TransferRefused(
                f"{self.url} refused the {self.backend} weight-transfer handshake "
                f"({type(error).__name__}: {error}{text}); was it started with "
                f"--weight-transfer-config '{{\"backend\": \"{self.backend}\"}}'?") from error

    def send(self, weights: dict[str, torch.Tensor]) -> None:
        """One update (blocking): connects first if needed."""
        from environments.inference.weight_transfer import StateDictSource

        if self.engine is None:
            self.connect(weights)
        self.engine.source = StateDictSource(weights)
        self.engine.send_weights()

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as error:  # noqa: BLE001 - the group is gone either way
                log.debug("closing the transfer group of %s: %s", self.url, error)
