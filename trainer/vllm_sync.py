"""Put the trainer's weights into running vLLM servers, in place.

CPU / development path (this module): save the weights as a HF checkpoint directory,
then, for every server, ``POST /pause`` (finish in-flight requests, hold new ones),
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``,
``POST /resume``. The servers must run with ``VLLM_SERVER_DEV_MODE=1`` (which exposes
``/collective_rpc``). After every server has the new weights, the caller posts the new
policy version to the rollout API, so envs stamp later turns with it.

On GPU, vLLM's NCCL weight-transfer endpoints (``/init_weight_transfer_engine``,
``/update_weights``) avoid the disk round trip; they need CUDA and are not used here.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    pass


class VLLMWeightSync:
    def __init__(self, urls: list[str], weights_dir: str | Path, *, timeout_s: float = 300.0,
                 keep: int = 2):
        self.urls = [u.rstrip("/") for u in urls]
        self.weights_dir = Path(weights_dir)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.keep = keep

    def save(self, model: Any, tokenizer: Any, version: int,
             weights: dict[str, Any] | None = None) -> Path:
        """Write the weights (safetensors) and tokenizer of ``version`` to disk
        (``weights``: the full state dict of a sharded model)."""
        path = self.weights_dir / f"v{version:06d}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        for old in sorted(self.weights_dir.glob("v*"))[:-self.keep]:
            if old.is_dir() and not old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)
        return path

    async def _post(self, session: aiohttp.ClientSession, url: str, json: Any = None) -> Any:
        async with session.post(url, json=json) as response:
            text = await response.text()
            if response.status >= 400:
                raise WeightSyncError(f"POST {url} -> {response.status}: {text[:500]}")
            return text

    async def reload(self, path: Path) -> float:
        """Load ``path`` into every server; returns the seconds it took."""
        started = time.monotonic()
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            async def one(url: str) -> None:
                await self._post(session, f"{url}/pause?mode=wait")
                try:
                    await self._post(session, f"{url}/collective_rpc", {
                        "method": "reload_weights", "kwargs": {"weights_path": str(path)}})
                finally:
                    await self._post(session, f"{url}/resume")

            await asyncio.gather(*(one(u) for u in self.urls))
        return time.monotonic() - started

    async def sync(self, model: Any, tokenizer: Any, version: int) -> tuple[Path, float]:
        path = await asyncio.to_thread(self.save, model, tokenizer, version)
        seconds = await self.reload(path)
        log.info("weights v%d loaded into %d vLLM server(s) in %.2f s", version,
                 len(self.urls), seconds)
        return path, seconds


class PolicyServers:
    """The vLLM servers that serve the policy: those the config names (``vllm_urls``) and,
    with ``vllm_launch``, one the trainer starts and restarts if it dies. After a step,
    :meth:`publish` puts the new weights into all of them."""

    def __init__(self, config: Any, run_dir: Path):
        self.config = config
        self.run_dir = run_dir
        self.managed = None
        self.sync: VLLMWeightSync | None = None
        self.latest: Path | None = None

    async def start(self) -> None:
        urls = list(self.config.vllm_urls)
        if self.config.vllm_launch:
            from trainer.vllm_manager import ManagedVLLM

            self.managed = ManagedVLLM(self.config.model, port=self.config.vllm_port,
                                       max_model_len=self.config.vllm_max_model_len,
                                       extra_args=self.config.vllm_args, log_dir=self.run_dir)
            urls.append(await asyncio.to_thread(self.managed.start))
        if urls:
            self.sync = VLLMWeightSync(urls, self.run_dir / "weights")

    async def check(self) -> dict[str, Any]:
        """Restart the launched server if it died (with the latest weights)."""
        if self.managed is not None and await asyncio.to_thread(self.managed.ensure_running,
                                                                self.latest):
            return {"vllm_restarts": self.managed.restarts}
        return {}

    async def publish(self, model: Any, tokenizer: Any, version: int,
                      weights: dict[str, Any] | None) -> dict[str, Any]:
        """Save ``version``'s weights and load them into every server; returns metrics."""
        if self.sync is None:
            return {}
        started = time.monotonic()
        values: dict[str, Any] = {}
        self.latest = await asyncio.to_thread(self.sync.save, model, tokenizer, version, weights)
        try:
            await self.sync.reload(self.latest)
        except (WeightSyncError, aiohttp.ClientError, asyncio.TimeoutError):
            # A launched server that died now restarts with the new weights.
            if self.managed is None or not await asyncio.to_thread(self.managed.ensure_running,
                                                                   self.latest):
                raise
            values["vllm_restarts"] = self.managed.restarts
        values["sync_seconds"] = time.monotonic() - started
        return values

    async def stop(self) -> dict[str, Any]:
        if self.managed is None:
            return {}
        await asyncio.to_thread(self.managed.stop)
        return {"vllm_url": self.managed.url, "vllm_restarts": self.managed.restarts}
