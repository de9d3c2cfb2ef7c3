"""Async client of the rollout API, used by envs (push) and the trainer (lease, ack).

Retries connection errors, timeouts, 429 and 5xx with exponential backoff; never retries
a 4xx (the request itself is wrong, and the server stored nothing). Pushes carry the
group's ``group_id``, so a retry after a lost response cannot store a group twice.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
import orjson
from pydantic import ValidationError

from environments.settings import bearer_headers
from environments.trajectory import ScoredGroup, TrajectoryError

RETRY_STATUSES = {429, 500, 502, 503, 504}
log = logging.getLogger("lachesis.api.client")


class APIRequestError(RuntimeError):
    """The API refused a request (4xx) or kept failing after all retries."""

    def __init__(self, status: int | None, message: str, body: Any = None):
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.body = body


@dataclass
class RejectedGroup:
    """A group that cannot be trained on: where it came from and what is wrong with it."""

    group_id: str
    env: str | None
    item_id: str | None
    reason: str

    @classmethod
    def of(cls, group: ScoredGroup | dict[str, Any], reason: str) -> RejectedGroup:
        get = group.get if isinstance(group, dict) else lambda k: getattr(group, k)
        return cls(str(get("group_id")), get("env"), get("item_id"), reason)

    def __str__(self) -> str:
        return f"group {self.group_id} (env {self.env}, item {self.item_id}): {self.reason}"


@dataclass
class LeasedBatch:
    lease_id: str
    step: int
    policy_version: int | None
    groups: list[ScoredGroup]
    rejected: list[RejectedGroup]
    """Groups of the lease that do not load as :class:`ScoredGroup` (acknowledge them as
    dead letters)."""


class RolloutAPIClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
        timeout_s: float = 60.0,
        gzip_min_bytes: int | None = 1024,
    ):
        self.url = url.rstrip("/")
        self.headers = bearer_headers(token)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        """How long one attempt may take (a long poll: this on top of its wait)."""
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.gzip_min_bytes = gzip_min_bytes
        self._session: aiohttp.ClientSession | None = None
        self.no_batch_reason: str | None = None
        """Why the last :meth:`lease` found no batch, as the API said."""
        self.no_batch_silent: list[dict[str, Any]] = []
        """The processes the API had not heard from when the last :meth:`lease` found no
        batch (``{"name", "kind", "silent_s", ...}``, as the API said)."""
        self.unanswered_s = 0.0
        """Seconds spent so far in attempts the API did not answer (a connection error,
        a timeout, a 5xx) and in the backoff after them."""
        self.on_unanswered: Callable[[float], None] | None = None
        """Called with the seconds of each attempt the API did not answer (the trainer
        counts them as ``time/hang_wait``)."""

    async def __aenter__(self) -> RolloutAPIClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        return self._session

    async def request(self, method: str, path: str, payload: Any = None,
                      body: bytes | None = None, wait_s: float = 0.0) -> Any:
        """Send one request (JSON ``payload`` or pre-encoded ``body``), with retries; each
        attempt may take ``timeout_s``, plus ``wait_s`` for a long poll. An attempt the
        API does not answer is logged (the API's address, the bound) and retried."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s + wait_s)
        headers = {}
        if payload is not None:
            body = orjson.dumps(payload)
        if body is not None:
            headers["Content-Type"] = "application/json"
            if self.gzip_min_bytes is not None and len(body) >= self.gzip_min_bytes:
                body = gzip.compress(body, compresslevel=1)
                headers["Content-Encoding"] = "gzip"
        last_error = "no attempt made"
        for attempt in range(self.retries + 1):
            started = time.monotonic()
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
            backed_off = time.monotonic()
            try:
                async with self.session.request(method, self.url + path, data=body,
                                                headers=headers, timeout=timeout) as response:
                    data = await response.read()
                    parsed = orjson.loads(data) if data else None
                    if response.status < 400:
                        if attempt:  # the backoff before this attempt
                            self._unanswered(backed_off - started)
                        return parsed
                    message = parsed.get("error", data.decode()) if isinstance(parsed, dict) else data.decode()
                    if response.status not in RETRY_STATUSES:
                        raise APIRequestError(response.status, message, parsed)
                    last_error = f"{response.status}: {message}"
            except asyncio.TimeoutError:
                last_error = (f"TimeoutError: no answer within {timeout.total:g} s "
                              f"(timeout_s {self.timeout_s:g} + wait {wait_s:g})")
            except (aiohttp.ClientError, orjson.JSONDecodeError) as error:
                last_error = f"{type(error).__name__}: {error}"
            self._unanswered(time.monotonic() - started)
            if attempt < self.retries:
                log.warning("rollout API at %s: %s %s unanswered (%s; attempt %d of %d); "
                            "retrying", self.url, method, path, last_error, attempt + 1,
                            self.retries + 1)
        raise APIRequestError(None, f"{method} {path} to the rollout API at {self.url} "
                                    f"failed after {self.retries + 1} attempts; last "
                                    f"error: {last_error}")

    def _unanswered(self, seconds: float) -> None:
        self.unanswered_s += seconds
        if self.on_unanswered is not None:
            self.on_unanswered(seconds)

    # -- envs -------------------------------------------------------------------------------
    async def register_env(self, name: str, *, group_size: int, max_token_length: int,
                           weight: float = 1.0, min_batch_allocation: float | None = None
                           ) -> dict[str, Any]:
        return await self.request("POST", "/register-env", {
            "desired_name": name, "group_size": group_size, "weight": weight,
            "max_token_length": max_token_length,
            "min_batch_allocation": min_batch_allocation})

    async def push_group(self, group: ScoredGroup) -> dict[str, Any]:
        """Push one group; returns ``{"status", "group_id", "duplicate", ...}``."""
        return await self.request("POST", "/scored_data",
                                  body=group.to_scored_data().model_dump_json().encode())

    async def push_groups(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        body = b"[" + b",".join(g.to_scored_data().model_dump_json().encode()
                               for g in groups) + b"]"
        return await self.request("POST", "/scored_data_list", body=body)

    async def env_status(self, env_id: int, *, wait_s: float = 0.0,
                         self_queued_sequences: int | None = None,
                         policy_version: int | None = None) -> dict[str, Any]:
        """The env's status; with ``wait_s``, a long poll: answered as soon as the env's
        queued sequences are no longer ``self_queued_sequences`` or the policy version no longer
        ``policy_version``, or after ``wait_s`` (``StatusWait``)."""
        query = f"env_id={env_id}"
        if wait_s:
            query += f"&wait_s={wait_s:g}&policy_version=" + \
                ("null" if policy_version is None else str(policy_version))
            if self_queued_sequences is not None:
                query += f"&self_queued_sequences={self_queued_sequences}"
        return await self.request("GET", f"/status-env?{query}", wait_s=wait_s)

    # -- trainer ----------------------------------------------------------------------------
    async def register_trainer(self, *, batch_size: int, max_token_len: int,
                               **fields: Any) -> dict[str, Any]:
        return await self.request("POST", "/register", {
            "batch_size": batch_size, "max_token_len": max_token_len, **fields})

    async def lease(self, batch_size: int | None = None,
                    trainer_id: str | None = None, wait_s: float = 0.0
                    ) -> LeasedBatch | None:
        """Lease the next batch, or None when not enough data is queued yet (the API's
        reason is then in :attr:`no_batch_reason`); ``wait_s``: the API waits up to that
        long for the batch to be complete."""
        data = await self.request("POST", "/lease",
                                  {"batch_size": batch_size, "trainer_id": trainer_id,
                                   **({"wait_s": wait_s} if wait_s else {})},
                                  wait_s=wait_s)
        if data["batch"] is None:
            self.no_batch_reason = data.get("reason")
            self.no_batch_silent = data.get("silent") or []
            return None
        self.no_batch_silent = []
        groups, rejected = [], []
        for body in data["batch"]:
            try:
                groups.append(ScoredGroup.from_scored_data(body))
            except (ValidationError, TrajectoryError) as error:
                rejected.append(RejectedGroup.of(body, f"invalid group: {error}"))
        return LeasedBatch(data["lease_id"], data["step"], data.get("policy_version"),
                           groups, rejected)

    async def ack(self, lease_id: str, dead_letters: list[RejectedGroup] | None = None,
                  step: int | None = None,
                  dropped: list[RejectedGroup] | None = None) -> dict[str, Any]:
        """Finish a lease; ``dead_letters``: its groups that could not be trained on (set
        aside by the API with their reasons, never redelivered); ``step``: the trainer
        step that trained the others (kept until :meth:`checkpoint` covers it);
        ``dropped``: groups the step used up without training on them (with a reason)."""
        return await self.request("POST", "/ack", {
            "lease_id": lease_id, "step": step,
            "dead_letters": [{"group_id": r.group_id, "reason": r.reason}
                             for r in dead_letters or []],
            "dropped": [{"group_id": r.group_id, "reason": r.reason}
                        for r in dropped or []]})

    async def resume(self, version: int, model: str | None = None,
                     trainer_id: str | None = None) -> dict[str, Any]:
        """The trainer restarted from its checkpoint of step ``version`` (``POST
        /resume``): leases released, groups trained after it queued again, the policy
        version rolled back."""
        return await self.request("POST", "/resume", {"version": version, "model": model,
                                                      "trainer_id": trainer_id})

    async def checkpoint(self, oldest_step: int) -> dict[str, Any]:
        """The oldest checkpoint the trainer may still resume from is ``oldest_step``."""
        return await self.request("POST", "/checkpoint", {"oldest_step": oldest_step})

    async def accounting(self) -> dict[str, Any]:
        return await self.request("GET", "/accounting")

    async def dead_letters(self, limit: int = 100) -> dict[str, Any]:
        """``{"total": n, "dead_letters": [{group_id, env_id, reason, trainer, at, group}]}``."""
        return await self.request("GET", f"/dead_letters?limit={limit}")

    async def nack(self, lease_id: str) -> dict[str, Any]:
        return await self.request("POST", "/nack", {"lease_id": lease_id})

    async def set_policy_version(self, version: int, model: str | None = None
                                 ) -> dict[str, Any]:
        """``model``: the name to request this version under (a LoRA adapter), if not the
        servers' base model."""
        return await self.request("POST", "/policy_version", {"version": version, "model": model})

    async def status(self) -> dict[str, Any]:
        return await self.request("GET", "/status")
