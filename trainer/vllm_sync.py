"""Put the trainer's weights into running vLLM servers, in place, by one of three methods
(``weight_sync``):

- ``disk``: save the weights as a HF checkpoint directory, then, for every server,
  ``POST /pause`` (see below), ``POST /collective_rpc {"method": "reload_weights",
  "kwargs": {"weights_path": DIR}}``, ``POST /resume``. The servers must run with
  ``VLLM_SERVER_DEV_MODE=1`` (which exposes ``/collective_rpc``).
- ``transfer``: the same pause and resume around an in-memory transfer through vLLM's
  weight-transfer API (:mod:`trainer.vllm_transfer`); disk is its fallback.
- ``lora``: only a LoRA adapter trains; it is hot-loaded under a versioned name
  (:mod:`trainer.lora`) and the rollouts switch to that name. Nothing pauses: a running
  request finishes on the adapter it named.

How a server pauses (``sync_pause``, :class:`PauseMode`):

- ``keep`` (default): ``POST /pause?mode=keep&clear_cache=false`` freezes running
  requests where they are (the pause returns at once, whatever is generating); once the
  new weights are in, the frozen requests are preempted (``POST
  /reset_prefix_cache?reset_running_requests=true``), which also empties the prefix cache,
  and after ``/resume`` they recompute their KV cache with the new weights and go on
  sampling. So every token after the update is sampled by exactly the new weights (no
  key/value computed by the old ones: neither a frozen request's own nor a cached
  prefix), and every token keeps the logprob of the weights that sampled it, which is
  what the importance ratio needs. A server that refuses ``keep`` (vLLM before 0.32) is
  paused with ``wait`` from then on. With ``stale_kv`` (``train.sync_stale_kv``) nothing
  is preempted and nothing recomputed: the frozen requests go on over the key/values the
  old weights computed, and the prefix cache keeps them for later requests too (what
  PipelineRL does; its paper measured the off-policyness this adds as negligible). A
  token after the update is then sampled by the new weights over older keys/values; its
  logprob is still the one it was sampled with.
- ``wait``: running requests finish first (the sync waits for the longest generation in
  flight); the KV and prefix caches are cleared after them.
- ``abort``: running requests end at once with finish reason ``abort`` and the tokens
  sampled so far; the env's client continues each on the new weights
  (:mod:`environments.inference.vllm_client`).

Every full-weight update is labelled on the server with its policy version (``POST
/update_weight_version``), so a request says which weights sampled which of its tokens
(vLLM's ``weight_versions``, read by the env's client).

``auto`` is ``lora`` with a ``lora`` section, else ``transfer`` where a server accepts it
and ``disk`` where it does not. After every server has the new weights, the caller posts
the new policy version (and, with LoRA, the model name to request) to the rollout API, so
envs stamp later turns with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import torch

from environments.inference.tied_weights import TIED_WEIGHTS_FILE, write_tied_weights
from environments.inference.vllm_client import inference_session
from trainer.lora import AdapterLoadError, LoraSync
from trainer.lora import vllm_options as lora_vllm_options
from trainer.losses import token_logprobs
from trainer.timing import unanswered

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
        """The HTTP status the server answered, when it answered."""


SYNC_ERRORS = (WeightSyncError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
"""How a sync to a server that died (or is restarting) fails."""


def sync_error_text(error: BaseException, timeout_s: float) -> str:
    """What a failed sync request says: its type and message; a timeout (whose message
    is empty) with the bound it exceeded."""
    if isinstance(error, asyncio.TimeoutError):
        return (f"{type(error).__name__}: no answer within {timeout_s:g} s "
                "(train.sync_timeout_s)")
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


PauseMode = Literal["keep", "wait", "abort"]


def path_version(path: Path) -> int | None:
    """The policy version of a weights directory written by :meth:`VLLMWeightSync.save`
    (``v000007`` -> 7)."""
    digits = path.name[1:].split("-")[0]
    return int(digits) if path.name.startswith("v") and digits.isdigit() else None


class VLLMWeightSync:
    def __init__(self, urls: list[str], weights_dir: str | Path, *, timeout_s: float = 300.0,
                 keep: int = 2, pause: PauseMode = "keep", stale_kv: bool = False):
        """``stale_kv`` (with ``keep``): the frozen requests and the prefix cache keep the
        key/values the old weights computed (no recompute after a sync; see the module
        doc)."""
        self.urls = [u.rstrip("/") for u in urls]
        self.weights_dir = Path(weights_dir)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.keep = keep
        self.pause_mode = pause
        self.stale_kv = stale_kv
        self.waits: set[str] = set()
        """Servers that refused ``keep``: paused with ``wait``."""

    def save(self, model: Any, tokenizer: Any, version: int,
             weights: dict[str, Any] | None = None) -> Path:
        """Write the weights (safetensors) and tokenizer of ``version`` to disk
        (``weights``: the full state dict of a sharded model)."""
        path = self.weights_dir / f"v{version:06d}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
        write_tied_weights(tmp, weights if weights is not None else model.state_dict())
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
                raise WeightSyncError(f"POST {url} -> {response.status}: {text[:500]}",
                                      response.status)
            return text

    def mode(self, url: str) -> PauseMode:
        return "wait" if self.pause_mode == "keep" and url in self.waits else self.pause_mode

    async def pause(self, session: aiohttp.ClientSession, url: str) -> None:
        """Pause one server for a weight update (``sync_pause``, see the module doc)."""
        if self.mode(url) == "keep":
            try:
                await self._post(session, f"{url}/pause?mode=keep&clear_cache=false")
                return
            except WeightSyncError as error:
                if error.status not in (400, 422):
                    raise
                log.warning("%s refused to pause with mode=keep (%s): its weight syncs wait "
                            "for running requests to finish", url, error)
                self.waits.add(url)
        await self._post(session, f"{url}/pause?mode={self.mode(url)}")

    async def resume(self, session: aiohttp.ClientSession, url: str,
                     version: int | None) -> None:
        """Label the server's new weights with ``version``, drop what the old weights
        computed (``keep``: the frozen requests' KV and the prefix cache), resume."""
        if version is not None:
            await self.label(session, url, version)
        if self.mode(url) == "keep" and not self.stale_kv:
            try:
                await self._post(session,
                                 f"{url}/reset_prefix_cache?reset_running_requests=true")
            except WeightSyncError as error:
                if error.status != 404:
                    raise
                # (a server without VLLM_SERVER_DEV_MODE): the frozen requests go on with
                # their old KV; their tokens' logprobs are still the ones they were
                # sampled with
                log.warning("%s has no /reset_prefix_cache: requests that ran across the "
                            "update keep the KV cache of the old weights", url)
        await self._post(session, f"{url}/resume")

    async def label(self, session: aiohttp.ClientSession, url: str,
                    version: int | str) -> None:
        """Name the weights ``url`` serves ``version`` (vLLM's weight version, which it
        reports per token to the env's client)."""
        try:
            await self._post(session, f"{url}/update_weight_version",
                             {"new_version": str(version)})
        except WeightSyncError as error:
            if error.status != 404:
                raise
            # a vLLM before 0.32: its tokens carry the version the envs know
            log.warning("%s cannot label its weights (no /update_weight_version)", url)

    async def reload_paused(self, session: aiohttp.ClientSession, url: str, path: Path) -> None:
        """Load ``path`` into one server that is paused already."""
        await self._post(session, f"{url}/collective_rpc", {
            "method": "reload_weights", "kwargs": {"weights_path": str(path)}})

    async def reload(self, path: Path, urls: list[str] | None = None) -> float:
        """Load ``path`` into every server (or ``urls``); returns the seconds it took."""
        started = time.monotonic()
        async with inference_session(timeout=self.timeout) as session:
            async def one(url: str) -> None:
                await self.pause(session, url)
                # A failed reload may leave part of the new weights: the server stays
                # paused (it serves nothing) and the error goes up.
                await self.reload_paused(session, url, path)
                await self.resume(session, url, path_version(path))

            await asyncio.gather(*(one(u) for u in urls or self.urls))
        return time.monotonic() - started

    async def sync(self, model: Any, tokenizer: Any, version: int) -> tuple[Path, float]:
        path = await asyncio.to_thread(self.save, model, tokenizer, version)
        seconds = await self.reload(path)
        log.info("weights v%d loaded into %d vLLM server(s) in %.2f s", version,
                 len(self.urls), seconds)
        return path, seconds


def sync_method(config: Any) -> str:
    """The ``weight_sync`` method a config resolves to (``auto``: see the module doc;
    a server that refuses a transfer is still synced from disk)."""
    if config.weight_sync != "auto":
        return config.weight_sync
    return "lora" if config.lora is not None else "transfer"


def vllm_options(config: Any) -> tuple[list[str], dict[str, str]]:
    """Arguments and environment a vLLM server needs for ``config``'s sync method."""
    method = sync_method(config)
    if method == "lora":
        return lora_vllm_options(config.lora)
    if method == "transfer":
        from trainer.vllm_transfer import transfer_backend
        from trainer.vllm_transfer import vllm_options as transfer_options

        return transfer_options(transfer_backend(config.transfer_backend))
    return [], {}


async def wait_until_answering(urls: list[str], poll_s: float = 0.5,
                               health_timeout_s: float = 5.0, say_every_s: float = 60.0) -> None:
    """Return once every server of ``urls`` answers ``/health`` (each check waits
    ``health_timeout_s``); says which it still waits for every ``say_every_s``."""
    waiting = list(urls)
    said = False
    started = time.monotonic()
    say_at = started + say_every_s
    while waiting:
        if time.monotonic() >= say_at:
            log.warning("still waiting for vLLM at %s to answer /health (%.0f s)",
                        ", ".join(waiting), time.monotonic() - started)
            say_at += say_every_s
        for url in list(waiting):
            try:
                async with inference_session(
                        timeout=aiohttp.ClientTimeout(total=health_timeout_s)) as session, \
                        session.get(url + "/health") as response:
                    if response.status == 200:
                        waiting.remove(url)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
        if waiting:
            if not said:
                log.info("waiting for vLLM at %s to answer", ", ".join(waiting))
                said = True
            await asyncio.sleep(poll_s)


@dataclass
class SyncSample:
    """Tokens a server sampled for the post-sync check, with its logprobs of them."""

    url: str
    tokens: list[int]
    """The prompt, then the sampled tokens."""
    prompt_len: int
    logprobs: list[float]
    """The server's logprob of each sampled token."""


async def sample_for_check(url: str, model_name: str, vocab_size: int, *,
                           prompt_len: int = 16, new_tokens: int = 8,
                           seed: int = 0) -> SyncSample:
    """``new_tokens`` tokens that the server samples (at temperature 1, under
    ``model_name``) after a prompt of random ids below ``vocab_size`` (the tokenizer's:
    vLLM refuses the padding rows of a larger embedding)."""
    prompt = torch.randint(0, vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    async with inference_session(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(f"{url}/v1/completions", json={
                "model": model_name, "prompt": prompt, "max_tokens": new_tokens,
                "temperature": 1.0, "seed": seed, "logprobs": 0, "return_token_ids": True,
                "ignore_eos": True}) as response:
            if response.status >= 400:
                raise WeightSyncError(f"{url}: sampling for the sync check failed: "
                                      f"{response.status} {(await response.text())[:300]}")
            choice = (await response.json())["choices"][0]
    return SyncSample(url, prompt + choice["token_ids"], prompt_len,
                      choice["logprobs"]["token_logprobs"])


def sample_gap(model: torch.nn.Module, sample: SyncSample) -> float:
    """Mean |trainer - server| logprob of the sample's sampled tokens. Under FSDP this is
    a collective: every rank calls it with the same sample."""
    tokens = torch.tensor([sample.tokens], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ours = token_logprobs(model(input_ids=tokens).logits, tokens)[0, sample.prompt_len:]
    finally:
        model.train(was_training)
    served = torch.tensor(sample.logprobs, dtype=torch.float32)
    return float((ours.float().cpu() - served).abs().mean())


async def served_logprob_gap(url: str, model_name: str, model: torch.nn.Module, *,
                             vocab_size: int | None = None, prompt_len: int = 16,
                             new_tokens: int = 8, seed: int = 0) -> float:
    """Mean |trainer - vLLM| logprob of ``new_tokens`` tokens that the server samples
    after a random prompt (:func:`sample_for_check`)."""
    vocab_size = vocab_size or model.get_input_embeddings().weight.shape[0]
    return sample_gap(model, await sample_for_check(
        url, model_name, vocab_size, prompt_len=prompt_len, new_tokens=new_tokens, seed=seed))


class PolicyServers:
    """The vLLM servers that serve the policy: those the config names (``vllm_urls``) and,
    with ``vllm_launch``, one the trainer starts and restarts if it dies. After a step,
    :meth:`publish` puts the new weights into all of them; ``model_name`` is then the name
    to request them under (a LoRA adapter's versioned name; None: the served model)."""

    def __init__(self, config: Any, run_dir: Path, *, check_sync: bool | None = None):
        self.config = config
        self.run_dir = run_dir
        self.method = sync_method(config)
        self.check_sync = config.check_sync if check_sync is None else check_sync
        self.managed = None
        self.sync: VLLMWeightSync | None = None
        self.latest: Path | None = None
        """The newest weights on disk (a restarted server loads them)."""
        self.transfers: dict[str, Any] = {}
        self.disk_only: set[str] = set()
        """Servers that refused transfers (``auto``): synced from disk."""
        self.lora = None
        self.model_name: str | None = None
        self.checked = False
        self.busy = None
        """Samples how busy the servers are (``vllm_busy_fraction`` after each sync)."""
        self.behind: set[str] = set()
        """Supervised servers (``vllm_supervised``) that missed a sync: each is loaded
        with the newest weights once it answers again."""

    @property
    def urls(self) -> list[str]:
        return self.sync.urls if self.sync is not None else []

    async def start(self) -> None:
        urls = list(self.config.vllm_urls)
        if self.config.vllm_launch:
            from trainer.vllm_manager import ManagedVLLM

            args, env = vllm_options(self.config)
            self.managed = ManagedVLLM(self.config.model, port=self.config.vllm_port,
                                       max_model_len=self.config.vllm_max_model_len,
                                       extra_args=[*self.config.vllm_args, *args], env=env,
                                       log_dir=self.run_dir)
            urls.append(await asyncio.to_thread(self.managed.start))
        if not urls:
            return
        if self.method == "transfer":  # vLLM's transfer engines: seconds of imports
            from environments.inference import weight_transfer  # noqa: F401
        if self.config.vllm_supervised:
            # The supervisor starts the trainer while its servers start (the model loads
            # meanwhile) and stops the run if one does not come up.
            await wait_until_answering(
                urls, health_timeout_s=self.config.vllm_health_timeout_s)
        self.sync = VLLMWeightSync(urls, self.run_dir / "weights",
                                   timeout_s=self.config.sync_timeout_s,
                                   pause=self.config.sync_pause,
                                   stale_kv=self.config.sync_stale_kv)
        from trainer.vllm_busy import BusySampler

        self.busy = BusySampler(self.urls).start()
        if self.method == "transfer":
            from trainer.vllm_transfer import ServerTransfer, transfer_backend

            backend = transfer_backend(self.config.transfer_backend)
            self.transfers = {url: ServerTransfer(url, backend,
                                                  timeout_s=self.config.sync_timeout_s)
                              for url in self.urls}
        elif self.method == "lora":
            self.lora = LoraSync(self.urls, self.run_dir / "adapters",
                                 await self._served_name(self.urls[0]), self.config.lora)

    async def check(self) -> dict[str, Any]:
        """Restart the launched server if it died (with the latest weights); load the
        newest weights into supervised servers that missed a sync and answer again."""
        if self.behind:
            return await self._catch_up()
        if self.managed is not None and await self._restart(force=False):
            return {"vllm_restarts": self.managed.restarts}
        return {}

    async def _catch_up(self) -> dict[str, Any]:
        for url in sorted(self.behind):
            try:
                async with inference_session(timeout=aiohttp.ClientTimeout(
                        total=self.config.vllm_health_timeout_s)) as session, \
                        session.get(url + "/health") as response:
                    if response.status != 200:
                        continue
                if url in self.transfers:  # a restarted server: a new handshake
                    await asyncio.to_thread(self.transfers[url].close)
                if self.lora is not None:  # restarted on the base model: the newest adapter
                    await self.lora.restore(url)
                elif self.latest is not None:
                    await self.sync.reload(self.latest, [url])
            except (*SYNC_ERRORS, AdapterLoadError):
                continue
            self.behind.discard(url)
            log.info("%s is back: loaded %s into it", url,
                     self.lora.loaded[-1][1] if self.lora is not None and self.lora.loaded
                     else self.latest)
        return {"vllm_behind": len(self.behind)}

    async def _publish_supervised(self, model: Any, tokenizer: Any, version: int,
                                  weights: dict[str, Any] | None,
                                  values: dict[str, Any]) -> None:
        """Sync every server that is up, each on its own: one that fails is left behind
        (its supervisor restarts it from the disk copy written first)."""
        await self._save(model, tokenizer, version, weights)
        urls = [u for u in self.urls if u not in self.behind]

        took: dict[str, float] = {}

        async def one(url: str) -> None:
            started = time.monotonic()
            try:
                if self.method == "transfer":
                    await self._transfer(model, tokenizer, version, weights, values, [url])
                else:
                    await self.sync.reload(self.latest, [url])
            finally:
                took[url] = time.monotonic() - started

        results = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
        done = [took[u] for u, r in zip(urls, results) if not isinstance(r, BaseException)]
        for url, result in zip(urls, results):
            if isinstance(result, SYNC_ERRORS):
                log.warning("weight sync v%d to %s failed (%s): it gets the weights when it "
                            "answers again", version, url,
                            sync_error_text(result, self.config.sync_timeout_s))
                self.behind.add(url)
                # the time beyond the servers that answered went on one that did not (it
                # timed out, or its supervisor killed it for hanging)
                unanswered(took[url] - max(done, default=0.0))
            elif isinstance(result, BaseException):
                raise result
        values["vllm_behind"] = len(self.behind)

    async def _restart(self, force: bool) -> bool:
        """(Re)start the launched server on the newest weights: the newest disk copy, and
        the newest adapter with LoRA. False when it was running fine (``force``: restart
        it anyway, e.g. it is paused on half-written weights)."""
        if not await asyncio.to_thread(self.managed.ensure_running, self.latest, force):
            return False
        url = self.managed.url
        if self.latest is not None and self.lora is None \
                and (version := path_version(self.latest)) is not None:
            try:
                async with inference_session(timeout=self.sync.timeout) as session:
                    await self.sync.label(session, url, version)
            except SYNC_ERRORS as error:  # its tokens then carry the envs' version
                log.warning("could not label %s's weights v%d: %s", url, version, error)
        if url in self.transfers:  # its workers are new: a new handshake
            self.transfers[url].close()
            self.disk_only.discard(url)
        if self.lora is not None:
            await self.lora.restore(url)
        return True

    async def _save(self, model: Any, tokenizer: Any, version: int,
                    weights: dict[str, Any] | None) -> Path:
        self.latest = await asyncio.to_thread(self.sync.save, model, tokenizer, version,
                                              weights)
        return self.latest

    async def publish(self, model: Any, tokenizer: Any, version: int,
                      weights: dict[str, Any] | None) -> dict[str, Any]:
        """Put ``version``'s weights into every server; returns metrics."""
        if self.sync is None:
            return {}
        started = time.monotonic()
        values: dict[str, Any] = {}
        try:
            if self.method == "lora":
                supervised = self.config.vllm_supervised
                self.model_name, failed = await self.lora.publish(
                    model, version, weights, skip=self.behind,
                    tolerate=(*SYNC_ERRORS, AdapterLoadError) if supervised else ())
                self.behind |= failed
                if supervised:
                    values["vllm_behind"] = len(self.behind)
            elif self.config.vllm_supervised:
                await self._publish_supervised(model, tokenizer, version, weights, values)
            elif self.method == "transfer":
                await self._transfer(model, tokenizer, version, weights, values)
            else:
                await self._save(model, tokenizer, version, weights)
                await self.sync.reload(self.latest)
        except (WeightSyncError, AdapterLoadError, aiohttp.ClientError,
                asyncio.TimeoutError) as error:
            # A launched server that died (or is stuck paused) restarts with the new weights.
            if self.managed is None:
                raise
            log.error("weight sync v%d failed (%s): restarting %s", version,
                      sync_error_text(error, self.config.sync_timeout_s), self.managed.url)
            if self.method == "lora":
                await self._restart(force=True)
                self.model_name, _ = await self.lora.publish(model, version, weights)
            else:
                if self.latest is None or self.latest.name != f"v{version:06d}":
                    await self._save(model, tokenizer, version, weights)
                await self._restart(force=True)
            values["vllm_restarts"] = self.managed.restarts
        values["sync_seconds"] = time.monotonic() - started
        if self.busy is not None and (busy := self.busy.take()) is not None:
            values["vllm_busy_fraction"] = busy  # since the previous sync
        if self.check_sync and (not self.checked or self.config.check_sync_every):
            values["sync_check_mean_abs_diff"] = await self.verify(
                model, len(tokenizer) if tokenizer is not None else None)
            values["sync_checked_servers"] = len(self.urls) - len(self.behind)
            self.checked = True
        return values

    async def _transfer(self, model: Any, tokenizer: Any, version: int,
                        weights: dict[str, Any] | None, values: dict[str, Any],
                        urls: list[str] | None = None) -> None:
        """Pause every server, stream the weights in, resume. A server whose transfer
        fails is reloaded from a disk copy before it resumes; one that refuses
        transfers (``auto``) is synced from disk from then on."""
        from trainer.vllm_transfer import TransferRefused

        state = weights if weights is not None else model.state_dict()
        disk_copy: asyncio.Task | None = None

        def on_disk() -> asyncio.Task:
            nonlocal disk_copy
            if disk_copy is None and self.latest is not None \
                    and self.latest.name == f"v{version:06d}":
                disk_copy = asyncio.ensure_future(asyncio.sleep(0, self.latest))
            if disk_copy is None:
                disk_copy = asyncio.ensure_future(self._save(model, tokenizer, version, weights))
            return disk_copy

        async with inference_session(timeout=self.sync.timeout) as session:
            async def one(url: str) -> None:
                await self.sync.pause(session, url)
                if url not in self.disk_only:
                    try:
                        await asyncio.to_thread(self.transfers[url].send, state)
                    except TransferRefused as error:
                        if self.config.weight_sync == "transfer":
                            raise WeightSyncError(str(error)) from None
                        log.warning("%s; syncing it from disk", error)
                        self.disk_only.add(url)
                    except Exception as error:  # noqa: BLE001 - any failure: disk fallback
                        log.error("weight transfer v%d to %s failed (%s: %s); reloading it "
                                  "from disk", version, url, type(error).__name__, error)
                        values["sync_fallbacks"] = values.get("sync_fallbacks", 0) + 1
                        self.transfers[url].close()
                    else:
                        await self.sync.resume(session, url, version)
                        return
                # The server is still paused: it resumes only with the whole new weights.
                await self.sync.reload_paused(session, url, await on_disk())
                await self.sync.resume(session, url, version)

            await asyncio.gather(*(one(u) for u in urls or self.urls))

    async def verify(self, model: Any, vocab_size: int | None = None) -> float:
        """The post-sync check: every server's logprobs of tokens it samples with the new
        weights equal the trainer's (mean |diff| below ``alignment_tolerance``)."""
        samples = await self.check_samples(vocab_size or model.get_input_embeddings()
                                           .weight.shape[0])
        return self.judge([sample_gap(model, s) for s in samples])

    async def check_samples(self, vocab_size: int) -> list[SyncSample]:
        """What every server that is not behind samples for the post-sync check (the
        trainer's side of it, :func:`sample_gap`, runs on every rank when the model is
        sharded). Supervised, a server that does not answer is left behind."""
        samples = []
        for url in [u for u in self.urls if u not in self.behind]:
            try:
                samples.append(await sample_for_check(
                    url, self.model_name or await self._served_name(url), vocab_size))
            except SYNC_ERRORS as error:
                if not self.config.vllm_supervised:
                    raise
                log.warning("sync check: %s did not answer (%s): it gets the weights when "
                            "it answers again", url, error)
                self.behind.add(url)
        return samples

    def judge(self, gaps: list[float]) -> float:
        """The worst server's gap; raises when it is past ``alignment_tolerance``."""
        worst = max(gaps, default=0.0)
        self.checked = True
        log.info("sync check: mean |trainer - vLLM| logprob after the sync = %.2e", worst)
        if worst >= self.config.alignment_bound('sync'):
            raise WeightSyncError(
                f"after the weight sync ({self.method}), vLLM's logprobs differ from the "
                f"trainer's by {worst:.3g} on average (tolerance "
                f"{self.config.alignment_bound('sync')}): the servers do not hold the trained "
                "weights")
        return worst

    async def _served_name(self, url: str) -> str:
        async with inference_session() as session:
            async with session.get(url + "/v1/models") as response:
                return (await response.json())["data"][0]["id"]

    async def stop(self) -> dict[str, Any]:
        if self.busy is not None:
            self.busy.stop()
        for transfer in self.transfers.values():
            await asyncio.to_thread(transfer.close)
        if self.managed is None:
            return {}
        await asyncio.to_thread(self.managed.stop)
        return {"vllm_url": self.managed.url, "vllm_restarts": self.managed.restarts}


async def sharded_sync_check(servers: PolicyServers | None, model: Any,
                             vocab_size: int) -> dict[str, Any]:
    """The post-sync check of a sharded (FSDP) model: the leader (``servers`` is not
    None) samples from every server, every rank gets the samples and runs the forward
    (a collective), and the leader judges the gaps."""
    from trainer.distributed import broadcast_object

    samples = broadcast_object(await servers.check_samples(vocab_size)
                               if servers is not None else None)
    gaps = [sample_gap(model, sample) for sample in samples]
    if servers is None:
        return {}
    return {"sync_check_mean_abs_diff": servers.judge(gaps)}
