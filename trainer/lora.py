"""LoRA training (peft) and hot-loading the adapter into running vLLM servers.

With ``lora:`` in the trainer config, the base model is frozen and only the adapter
matrices train (``W x + (alpha / rank) B A x``; ``B`` starts at zero, so step 0 is the
base model). After a step, the adapter (a few MB, not the model) is saved and loaded into
every vLLM server with ``POST /v1/load_lora_adapter`` under a versioned name
(``<served name>-lora-v000007``); the new version and that name go to the rollout API,
whose ``/status`` tells env servers to send their next requests to it. Requests already
running finish on the adapter they started with, so no pause is needed, and vLLM loads and
checks an adapter before it serves it, so a failed load leaves the previous one serving.

vLLM must run with ``--enable-lora --max-lora-rank R`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (:func:`vllm_options`). Versioned names rather than
one name loaded in place (vLLM 0.32 has ``load_inplace``): a request names exactly the
weights it wants, and a version's name never means other weights later.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from environments.inference.vllm_client import inference_session

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM 0.32 accepts."""


class AdapterLoadError(RuntimeError):
    """A server refused (or could not be asked) to load or unload an adapter."""


class LoraSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int = Field(default=8, ge=1, le=VLLM_LORA_RANKS[-1])
    """``r``: the adapter's inner dimension."""
    alpha: float = Field(default=16.0, gt=0)
    """The update is scaled by ``alpha / rank``."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (vLLM samples without it)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                 "gate_proj", "up_proj", "down_proj"], min_length=1)
    """Names of the linear layers that get an adapter."""
    keep_loaded: int = Field(default=3, ge=2)
    """Adapter versions each vLLM server keeps loaded (the newest and older ones).
    Envs switch to a new one within their status poll; until then their requests name an
    older one, which must still be there."""


def vllm_options(settings: LoraSettings) -> tuple[list[str], dict[str, str]]:
    """Command-line arguments and environment for a vLLM server that hot-loads adapters."""
    max_rank = next(r for r in VLLM_LORA_RANKS if r >= settings.rank)
    return (["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "2"],
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})


def apply_lora(model: Any, settings: LoraSettings, checkpoint: Path | None = None) -> Any:
    """``model`` with a trainable LoRA adapter (the one saved in ``checkpoint``, when
    resuming) and every other parameter frozen."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if checkpoint is not None:
        return PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                        lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none",
                        task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # peft names the modules it could not find
        raise ValueError(f"lora.target_modules {settings.target_modules}: {error}") from None


class LoraSync:
    """Save an adapter version and load it into every server under its versioned name."""

    def __init__(self, urls: list[str], adapters_dir: Path, base_name: str,
                 settings: LoraSettings, timeout_s: float = 300.0):
        self.urls = [u.rstrip("/") for u in urls]
        self.adapters_dir = adapters_dir
        self.base_name = base_name
        self.keep = settings.keep_loaded
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.loaded: list[tuple[str, Path]] = []
        """(name, path) of the versions loaded, oldest first."""

    def name(self, version: int) -> str:
        return f"{self.base_name}-lora-v{version:06d}"

    def save(self, model: Any, version: int, weights: dict[str, Any] | None = None) -> Path:
        """Write the adapter of ``version`` (``weights``: the full state dict of a sharded
        model); a directory appears whole or not at all."""
        path = self.adapters_dir / f"v{version:06d}"
        for n in itertools.count(1):  # a resumed run may re-publish a version: a new path
            if not path.exists():
                break
            path = self.adapters_dir / f"v{version:06d}-{n}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=weights)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        return path

    async def _post(self, session: aiohttp.ClientSession, url: str, body: dict) -> None:
        async with session.post(url, json=body) as response:
            if response.status >= 400:
                text = await response.text()
                raise AdapterLoadError(f"POST {url} -> {response.status}: {text[:500]}")

    async def load(self, name: str, path: Path, urls: list[str] | None = None,
                   tolerate: tuple[type[BaseException], ...] = ()) -> set[str]:
        """Load adapter ``path`` as ``name`` into ``urls`` (all servers by default).
        Returns the servers that failed with one of ``tolerate``; other errors raise."""
        urls = urls if urls is not None else self.urls
        async with inference_session(timeout=self.timeout) as session:
            results = await asyncio.gather(*(
                # in place: a run resumed from an older checkpoint publishes names the
                # servers may hold already; the path is new, and vLLM's prefix cache keys
                # adapter blocks by name and path, so none of the old blocks is reused
                self._post(session, f"{url}/v1/load_lora_adapter",
                           {"lora_name": name, "lora_path": str(path), "load_inplace": True})
                for url in urls), return_exceptions=True)
        failed = set()
        for url, result in zip(urls, results):
            if isinstance(result, tolerate):
                log.warning("adapter %s not loaded into %s (%s): it gets the newest when it "
                            "answers again", name, url, result)
                failed.add(url)
            elif isinstance(result, BaseException):
                raise result
        return failed

    async def publish(self, model: Any, version: int, weights: dict[str, Any] | None = None,
                      skip: set[str] | frozenset[str] = frozenset(),
                      tolerate: tuple[type[BaseException], ...] = ()) -> tuple[str, set[str]]:
        """Save ``version``'s adapter, load it into every server but ``skip``, unload (and
        delete) the versions beyond ``keep_loaded``; returns the name to serve it under
        and the servers that failed with one of ``tolerate`` (supervised replicas that
        died: :meth:`restore` loads the newest into them when they are back)."""
        path = await asyncio.to_thread(self.save, model, version, weights)
        name = self.name(version)
        failed = await self.load(name, path, [u for u in self.urls if u not in skip], tolerate)
        self.loaded.append((name, path))
        old, self.loaded = self.loaded[:-self.keep], self.loaded[-self.keep:]
        async with inference_session(timeout=self.timeout) as session:
            for old_name, old_path in old:
                for url in self.urls:
                    try:
                        await self._post(session, f"{url}/v1/unload_lora_adapter",
                                         {"lora_name": old_name})
                    except Exception as error:  # noqa: BLE001 - a leftover costs a slot only
                        log.warning("could not unload %s from %s: %s", old_name, url, error)
                shutil.rmtree(old_path, ignore_errors=True)
        return name, failed

    async def restore(self, url: str) -> str | None:
        """Load the newest adapter into a (restarted) server; returns its name."""
        if not self.loaded:
            return None
        name, path = self.loaded[-1]
        await self.load(name, path, [url.rstrip("/")])
        return name
