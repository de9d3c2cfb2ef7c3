"""Token-in/token-out completions from one or several vLLM servers.

Each request sends the prompt as token ids to ``/inference/v1/generate`` (vLLM 0.32's
token-in/token-out route, served with ``--enable-scale-out``), or to ``/v1/completions``
with ``return_token_ids: true`` and ``logprobs: 0`` where a server lacks that route; the
sampled ids and their logprobs are kept exactly as vLLM returned them. The generate route
also says which weights sampled which tokens (``weight_versions``: the label the trainer
gives each weight update, see trainer/vllm_sync.py), so a turn that runs across an
in-flight weight update (``sync_pause: keep``) records where the new weights took over.

A request that a weight update aborted (``sync_pause: abort``: finish reason ``abort``)
is continued: the tokens sampled so far are appended to the prompt and the rest is
sampled, after the update, by the new weights; the continuation's tokens carry the new
version.

Identical requests made at the same moment (the same prompt ids, token budget and
sampling settings, unseeded: the first turns of a group's rollouts, or an Atropos env's
``n`` completions) go to vLLM as one request with ``n`` set to how many there are
(``share_identical``); each caller gets its own choice, sampled independently as before.
One request instead of ``n`` saves the HTTP round trip, vLLM's request handling and its
prompt processing ``n - 1`` times; the callers get their answers together, when the
longest of the ``n`` is done.

Routing: a request goes to the healthy server with the fewest requests in flight (ties
broken round-robin). A server that fails (connection error, timeout, 5xx) is marked
unhealthy and the request is retried on another one with exponential backoff; an
unhealthy server gets requests again once ``GET /health`` answers 200 (checked in the
background every ``health_interval_s``). A 404 (the server does not serve the requested
model: a replica restarted on the base model before its LoRA adapter is loaded again) is
treated the same way; any other 4xx is the request's own fault and is not retried. When
no server is healthy (one vLLM, being restarted), requests wait for one to answer
``/health`` (every second, up to ``outage_wait_s``) instead of spending their retries.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from environments.settings import bearer_headers, run_token

log = logging.getLogger(__name__)


class InferenceError(RuntimeError):
    """A completion could not be obtained (bad request, or every retry failed)."""


class ContextLengthError(InferenceError):
    """The server refused the prompt as longer than its ``max_model_len`` (vLLM: 400,
    "This model's maximum context length is ..." on ``/v1/completions``, "The decoder
    prompt (length N) is longer than the maximum model length of M" on the generate
    route). The start check
    (:mod:`environments.framework.limits`) keeps envs' limits within it; this is what a
    server that did not report its limit, or one restarted with a smaller one, answers."""


FORCED_EXTRA_ARG = "lachesis_forced_token_ids"
"""The ``extra_args`` key of a forced turn's token ids
(:data:`environments.inference.forced_tokens.EXTRA_ARG`, which imports vLLM)."""


def continued(sampling: dict[str, Any] | None, produced: int) -> dict[str, Any] | None:
    """The sampling parameters of a request's continuation after ``produced`` tokens: a
    forced turn's ids lose the ones already given (its continuation goes on with the
    next, not from the first again)."""
    extra = (sampling or {}).get("extra_args") or {}
    if not extra.get(FORCED_EXTRA_ARG):
        return sampling
    return {**sampling, "extra_args": {**extra,
                                       FORCED_EXTRA_ARG: extra[FORCED_EXTRA_ARG][produced:]}}

@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """``"stop"`` (eos or stop string), ``"length"`` (max_tokens reached), ..."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the turn, when vLLM says."""
    server: str
    weight_versions: list[tuple[str, int, int]] | None = None
    """``(label, start, end)``: the tokens ``[start, end)`` of ``token_ids`` were sampled
    by the weights labelled ``label`` (vLLM's weight version: ``"default"`` until the
    trainer labels an update); None when the server does not say (``/v1/completions``)."""


@dataclass
class ServerState:
    url: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    last_error: str | None = None
    max_model_len: int | None = None
    """The longest sequence (prompt plus completion) it serves, as its ``/v1/models``
    said at start (vLLM reports it; None: not said, or the server was down)."""
    generate: bool = False
    """It serves ``/inference/v1/generate`` (vLLM started with ``--enable-scale-out``),
    which reports the weight version of each token; else ``/v1/completions``."""


@dataclass
class PoolStats:
    requests: int = 0
    retries: int = 0
    failures: int = 0
    completion_tokens: int = 0
    shared: int = 0
    """Requests that went to vLLM inside another identical one (``n`` > 1)."""
    continued: int = 0
    """Requests that a weight update aborted (``sync_pause: abort``) and that were
    continued on the new weights."""


def inference_session(**kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session that sends the run's token (``LACHESIS_API_TOKEN``) to the vLLM
    servers with every request (``kwargs``: the session's other settings)."""
    return aiohttp.ClientSession(headers=bearer_headers(run_token()), **kwargs)


class VLLMServerPool:
    """Least-loaded routing over vLLM OpenAI-compatible servers."""

    def __init__(self, urls: list[str], model: str | None = None, *, api_key: str | None = None,
                 timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 0.5,
                 health_interval_s: float = 5.0, outage_wait_s: float = 600.0,
                 share_identical: bool = True):
        """``outage_wait_s``: how long a request waits for a server to answer ``/health``
        again when none is healthy (a supervised vLLM restarting) before it fails; the
        wait spends none of its ``retries``. ``share_identical``: identical requests made
        at the same moment go as one request with ``n`` (see the module doc)."""
        if not urls:
            raise ValueError("at least one inference server URL is needed")
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self.model = model
        self.headers = bearer_headers(api_key)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.health_interval_s = health_interval_s
        self.outage_wait_s = outage_wait_s
        self.stats = PoolStats()
        self._round_robin = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._outage: asyncio.Future | None = None
        self.share_identical = share_identical
        self._forming: dict[Any, _SharedRequest] = {}

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> VLLMServerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Check every server once, learn the served model name and each server's
        ``max_model_len`` (``/v1/models``), start health checks."""
        await asyncio.gather(*(self._check(s) for s in self.servers))
        healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            raise InferenceError("no inference server is healthy: " + "; ".join(
                f"{s.url}: {s.last_error}" for s in self.servers))
        listed = await asyncio.gather(*(self._models(s) for s in healthy))
        routes = await asyncio.gather(*(self._has_generate(s) for s in healthy))
        for server, has in zip(healthy, routes):
            server.generate = has
        if self.model is None:
            first = next((models for models in listed if models), None)
            if first is None:
                raise InferenceError(f"{healthy[0].url}/v1/models lists no model; set the "
                                     "model name")
            self.model = first[0]["id"]
        for server, models in zip(healthy, listed):
            entry = next((m for m in models if m.get("id") == self.model),
                         models[0] if models else {})
            limit = entry.get("max_model_len")
            server.max_model_len = limit if type(limit) is int and limit > 0 else None
        self._health_task = asyncio.create_task(self._health_loop())

    async def _models(self, server: ServerState) -> list[dict[str, Any]]:
        """The entries of ``server``'s ``GET /v1/models`` (empty when it cannot say)."""
        try:
            async with self.session.get(server.url + "/v1/models",
                                        timeout=aiohttp.ClientTimeout(total=30)) as response:
                data = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            log.warning("GET %s/v1/models failed: %s", server.url, error)
            return []
        models = data.get("data") if isinstance(data, dict) else None
        return [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []

    async def _has_generate(self, server: ServerState) -> bool:
        """Whether ``server`` serves ``/inference/v1/generate`` (listed in its OpenAPI
        schema; vLLM lists it only when it is enabled)."""
        try:
            async with self.session.get(server.url + "/openapi.json",
                                        timeout=aiohttp.ClientTimeout(total=30)) as response:
                data = await response.json(content_type=None) if response.status == 200 \
                    else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False
        return isinstance(data, dict) and GENERATE_ROUTE in (data.get("paths") or {})

    @property
    def context_limits(self) -> dict[str, int | None]:
        """Each server's ``max_model_len`` as read at start (None: unknown)."""
        return {s.url: s.max_model_len for s in self.servers}

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # vLLM's server (uvicorn) drops idle keep-alive connections after 5 s; reusing
            # one it just closed fails the request, so let ours expire first.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers,
                                                  connector=connector)
        return self._session

    async def _check(self, server: ServerState) -> None:
        try:
            async with self.session.get(server.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=5)) as response:
                ok = response.status == 200
                server.last_error = None if ok else f"GET /health -> {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            ok, server.last_error = False, f"{type(error).__name__}: {error}"
        if ok != server.healthy:
            log.warning("inference server %s is %s", server.url,
                        "healthy again" if ok else f"unhealthy ({server.last_error})")
        server.healthy = ok

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check(s) for s in self.servers if not s.healthy))

    async def _wait_for_a_server(self, poll_s: float = 1.0) -> None:
        """Return once a server is healthy; while none is, check them all every ``poll_s``
        (one wait for every request that finds them all down), for at most
        ``outage_wait_s``."""
        if any(s.healthy for s in self.servers):
            return
        if self._outage is None or self._outage.done():
            self._outage = asyncio.ensure_future(self._outage_watch(poll_s))
        await asyncio.shield(self._outage)

    async def _outage_watch(self, poll_s: float) -> None:
        log.warning("no inference server is healthy; waiting up to %.0f s for one to answer",
                    self.outage_wait_s)
        deadline = time.monotonic() + self.outage_wait_s
        while True:
            await asyncio.gather(*(self._check(s) for s in self.servers))
            if any(s.healthy for s in self.servers):
                return
            if time.monotonic() >= deadline:
                raise InferenceError(
                    f"no inference server answered for {self.outage_wait_s:.0f} s: " +
                    "; ".join(f"{s.url}: {s.last_error}" for s in self.servers))
            await asyncio.sleep(poll_s)

    def _pick(self, exclude: set[str]) -> ServerState:
        candidates = [s for s in self.servers if s.healthy and s.url not in exclude]
        if not candidates:  # all tried or unhealthy: try anything healthy, then anything
            candidates = [s for s in self.servers if s.healthy] or self.servers
        least = min(s.in_flight for s in candidates)
        tied = [s for s in candidates if s.in_flight == least]
        return tied[next(self._round_robin) % len(tied)]

    # -- completions -------------------------------------------------------------------
    async def complete(self, prompt_ids: list[int], *, max_tokens: int,
                       sampling: dict[str, Any] | None = None) -> Completion:
        """Sample one continuation of ``prompt_ids``; a request that a weight update
        aborted is continued from where it stopped (see the module doc)."""
        self.stats.requests += 1
        if self.share_identical and "seed" not in (sampling or {}):
            done = await self._shared(prompt_ids, max_tokens, sampling)
        else:
            done, = await self._request(prompt_ids, max_tokens, sampling)
        stalled = 0  # continuations in a row that got no token (aborted again at once)
        while done.finish_reason == "abort" and len(done.token_ids) < max_tokens \
                and stalled < MAX_STALLED_CONTINUATIONS:
            self.stats.continued += 1
            more, = await self._request(prompt_ids + done.token_ids,
                                        max_tokens - len(done.token_ids),
                                        continued(sampling, len(done.token_ids)))
            stalled = 0 if more.token_ids else stalled + 1
            done = join_completions(done, more)
        return done

    async def _shared(self, prompt_ids: list[int], max_tokens: int,
                      sampling: dict[str, Any] | None) -> Completion:
        """Join the identical request being formed in this turn of the event loop, or
        form one: it is sent once the tasks already running have had their turn (the
        other rollouts of a group, started together), with ``n`` = its callers."""
        key = (tuple(prompt_ids), max_tokens,
               json.dumps(sampling or {}, sort_keys=True, default=str))
        shared = self._forming.get(key)
        if shared is None or len(shared.waiters) >= MAX_SHARED:
            shared = self._forming[key] = _SharedRequest()
            loop = asyncio.get_running_loop()
            # two turns of the loop: callers that start right after this one get in too
            loop.call_soon(loop.call_soon, self._send_shared, key, shared, prompt_ids,
                           max_tokens, sampling)
        waiter = asyncio.get_running_loop().create_future()
        shared.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if shared.task is not None and all(w.cancelled() for w in shared.waiters):
                shared.task.cancel()  # nobody waits for it any more
            raise

    def _send_shared(self, key: Any, shared: _SharedRequest, prompt_ids: list[int],
                     max_tokens: int, sampling: dict[str, Any] | None) -> None:
        if self._forming.get(key) is shared:
            del self._forming[key]
        shared.waiters = [w for w in shared.waiters if not w.done()]  # (cancelled already)
        n = len(shared.waiters)
        if n == 0:
            return
        self.stats.shared += n - 1
        shared.task = asyncio.ensure_future(self._request(prompt_ids, max_tokens, sampling, n))

        def hand_out(task: asyncio.Task) -> None:
            error = None if task.cancelled() else task.exception()
            for i, waiter in enumerate(shared.waiters):
                if waiter.done():
                    continue
                if task.cancelled():
                    waiter.cancel()
                elif error is not None:
                    waiter.set_exception(error)
                else:
                    waiter.set_result(task.result()[i])

        shared.task.add_done_callback(hand_out)

    async def _request(self, prompt_ids: list[int], max_tokens: int,
                       sampling: dict[str, Any] | None, n: int = 1) -> list[Completion]:
        """``n`` continuations of ``prompt_ids`` in one request."""
        tried: set[str] = set()
        last_error = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats.retries += 1
                delay = self.backoff_s * 2 ** (attempt - 1)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
            try:
                await self._wait_for_a_server()
            except InferenceError:
                self.stats.failures += 1
                raise
            server = self._pick(tried)
            tried.add(server.url)
            server.in_flight += n
            server.requests += 1
            if server.generate:
                route = GENERATE_ROUTE
                # token ids out: nothing to detokenize, unless stop strings are to be
                # found in the text
                detokenize = bool((sampling or {}).get("stop"))
                payload = {"model": self.model, "token_ids": prompt_ids,
                           "sampling_params": {"detokenize": detokenize, **(sampling or {}),
                                               "max_tokens": max_tokens, "logprobs": 0,
                                               "n": n}}
            else:
                route = "/v1/completions"
                payload = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                           **(sampling or {}), "logprobs": 0, "return_token_ids": True,
                           "n": n, "stream": False}
            try:
                async with self.session.post(server.url + route, json=payload) as response:
                    data = await response.json(content_type=None)
                    if response.status >= 500:
                        raise _ServerFault(f"{response.status}: {data}")
                    if response.status == 404:  # it does not serve the model (yet): a
                        # replica restarted on the base model, before its adapter is back
                        raise _ServerFault(f"404, model {self.model!r}: {data}")
                    if response.status >= 400:
                        message = data.get("error", data) if isinstance(data, dict) else data
                        error = ContextLengthError if response.status == 400 and \
                            _refuses_the_context(message) else InferenceError
                        raise error(f"{server.url} refused the request "
                                    f"({response.status}): {message}")
                return self._completions(data, server.url, n)
            except (_ServerFault, aiohttp.ClientError, asyncio.TimeoutError) as error:
                last_error = f"{server.url}: {type(error).__name__}: {error}"
                server.failures += 1
                server.last_error = last_error
                server.healthy = False
                log.warning("completion failed on %s (%s); retrying elsewhere", server.url, error)
            finally:
                server.in_flight -= n
        self.stats.failures += 1
        raise InferenceError(f"completion failed after {self.retries + 1} attempts; "
                             f"last error: {last_error}")

    def _completions(self, data: dict[str, Any], url: str, n: int) -> list[Completion]:
        choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise InferenceError(f"{url} returned {len(choices)} choices for n={n}")
        return [self._completion(choice, url) for choice in choices]

    def _completion(self, choice: dict[str, Any], url: str) -> Completion:
        token_ids = choice.get("token_ids")
        if token_ids is None:
            raise InferenceError(f"{url} returned no token_ids: is it vLLM >= 0.10 "
                                 "(return_token_ids)?")
        logprobs = choice.get("logprobs") or {}
        if "content" in logprobs:  # the generate route: one entry per sampled token
            logprobs = [entry["logprob"] for entry in logprobs["content"] or []]
        else:
            logprobs = logprobs.get("token_logprobs")
        if logprobs is None or len(logprobs) != len(token_ids):
            raise InferenceError(f"{url} returned {len(logprobs or [])} logprobs for "
                                 f"{len(token_ids)} tokens")
        self.stats.completion_tokens += len(token_ids)
        spans = choice.get("weight_versions")
        return Completion(list(token_ids), [float(x) for x in logprobs],
                          choice.get("finish_reason") or "stop", choice.get("stop_reason"), url,
                          [(str(v["version"]), int(v["start"]), int(v["end"])) for v in spans]
                          if spans is not None else None)

    def describe(self) -> dict[str, Any]:
        return {s.url: {"healthy": s.healthy, "in_flight": s.in_flight,
                        "requests": s.requests, "failures": s.failures,
                        "last_error": s.last_error} for s in self.servers}


class _ServerFault(Exception):
    pass


@dataclass
class _SharedRequest:
    """Identical requests sent as one with ``n``: a future per caller."""
    waiters: list[asyncio.Future] = field(default_factory=list)
    task: asyncio.Task | None = None


def _refuses_the_context(message: Any) -> bool:
    """Whether a vLLM 400 says the prompt does not fit ``max_model_len`` (each route words
    it its own way)."""
    text = str(message)
    return "maximum context length" in text or "longer than the maximum model length" in text


GENERATE_ROUTE = "/inference/v1/generate"
MAX_SHARED = 64
"""At most this many identical requests go as one (vLLM refuses ``n`` above its
``max_num_seqs``, 256 by default on CPU)."""
MAX_STALLED_CONTINUATIONS = 16
"""An aborted request is continued until this many continuations in a row got no token;
then the turn ends as vLLM ended it (finish reason ``abort``)."""


def join_completions(first: Completion, then: Completion) -> Completion:
    """``first`` (aborted by a weight update) followed by its continuation ``then``; the
    continuation's version spans move past ``first``'s tokens. Spans are known only when
    both say them (a request aborted before its first token says ``[]``)."""
    n = len(first.token_ids)
    spans = None
    if first.weight_versions is not None and then.weight_versions is not None:
        spans = list(first.weight_versions) + [(v, s + n, e + n)
                                                for v, s, e in then.weight_versions]
    return Completion(first.token_ids + then.token_ids, first.logprobs + then.logprobs,
                      then.finish_reason, then.stop_reason, then.server, spans)
