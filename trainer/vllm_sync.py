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
