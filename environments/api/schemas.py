"""Request bodies of the rollout API (other than scored data) and the server's config."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from environments.settings import load_settings, run_token
from environments.trajectory import MAX_INT


class Registration(BaseModel):
    """``POST /register``: the trainer (Atropos fields)."""

    wandb_group: str = ""
    wandb_project: str = ""
    batch_size: int = Field(gt=0, le=MAX_INT)
    max_token_len: int = Field(gt=0, le=MAX_INT)
    checkpoint_dir: str = ""
    save_checkpoint_interval: int = Field(default=0, ge=-MAX_INT, le=MAX_INT)
    starting_step: int = Field(default=0, ge=0, le=MAX_INT)
    num_steps: int = Field(default=-1, ge=-1, le=MAX_INT)


class RegisterEnv(BaseModel):
    """``POST /register-env`` (Atropos fields)."""

    max_token_length: int = Field(gt=0, le=MAX_INT)
    desired_name: str = Field(min_length=1)
    weight: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    group_size: int = Field(gt=0, le=MAX_INT)
    min_batch_allocation: float | None = Field(default=None, ge=0, le=1)


class EnvIdentifier(BaseModel):
    env_id: int = Field(ge=0, le=MAX_INT)


class StatusWait(BaseModel):
    """``GET /status-env``'s long poll, in its query: the env says what it knows (its
    ``self_queued_sequences``, the ``policy_version``; ``null``: none yet) and the answer
    comes as soon as either is out of date, or after ``wait_s`` at the latest. Without
    ``wait_s`` the answer comes at once, as Atropos envs expect. An env paced on its
    queue learns of the trainer's lease the moment it happens, with one request waiting
    instead of a poll every so often."""

    wait_s: float = Field(default=0.0, ge=0, le=60, allow_inf_nan=False)
    self_queued_sequences: int | None = Field(default=None, ge=0, le=MAX_INT)
    policy_version: int | None = Field(default=None, ge=0, le=MAX_INT)
    watch_version: bool = False
    """Whether the query named ``policy_version`` (``null`` is a version to watch too)."""

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> StatusWait:
        fields: dict[str, object] = {k: query[k] for k in ("wait_s", "self_queued_sequences")
                                     if k in query}
        if "policy_version" in query:
            version = query["policy_version"]
            fields.update(policy_version=None if version == "null" else version,
                          watch_version=True)
        wait = cls.model_validate(fields)
        if wait.wait_s and wait.self_queued_sequences is None and not wait.watch_version:
            raise ValueError("wait_s waits for self_queued_sequences or policy_version to "
                             "change: give one")
        return wait

    def answered_by(self, status: Mapping[str, object]) -> bool:
        """Whether ``status`` (``/status-env``'s answer) is what the poll waits for."""
        if not self.wait_s:
            return True
        if self.self_queued_sequences is not None and \
                status["self_queued_sequences"] != self.self_queued_sequences:
            return True
        return self.watch_version and status["policy_version"] != self.policy_version


class LeaseRequest(BaseModel):
    """``POST /lease``: a batch the trainer acknowledges after its step."""

    batch_size: int | None = Field(default=None, gt=0, le=MAX_INT)
    """Sequences wanted; defaults to the registered trainer's batch size."""
    trainer_id: str | None = None
    wait_s: float = Field(default=0.0, ge=0, le=60, allow_inf_nan=False)
    """Wait up to this long for a batch (answered the moment one is complete) instead of
    answering at once that none is."""


class LeaseId(BaseModel):
    lease_id: str


class DeadLetterRequest(BaseModel):
    """A leased group the trainer could not train on: set aside, not redelivered."""

    group_id: str = Field(min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=10_000)
    """What is wrong with it (the trainer's error), shown by ``/dead_letters`` and
    ``lachesis inspect --dead-letters``."""


class Ack(BaseModel):
    """``POST /ack``: the trainer is done with a lease."""

    lease_id: str
    dead_letters: list[DeadLetterRequest] = Field(default_factory=list)
    """Groups of the lease that could not be trained on; the rest were trained."""
    dropped: list[DeadLetterRequest] = Field(default_factory=list)
    """Groups of the lease the step used up without training on them (every reward
    equal, left out by dynamic sampling): dropped, counted under their reason."""
    step: int | None = Field(default=None, ge=0, le=MAX_INT)
    """The trainer step whose update holds the lease's groups. Given, the API keeps their
    bodies until a checkpoint covers that step (``POST /checkpoint``), so a trainer that
    resumes from an older checkpoint trains them again (``POST /resume``); not given,
    they are forgotten at once."""


class Resume(BaseModel):
    """``POST /resume``: the trainer (re)started from its checkpoint of step ``version``."""

    version: int = Field(ge=0, le=MAX_INT)
    """The step of the checkpoint the trainer resumed from: the policy version the
    inference servers now serve."""
    model: str | None = Field(default=None, min_length=1, max_length=512)
    """The model name that version is served under (a LoRA adapter), as in
    ``POST /policy_version``."""
    trainer_id: str | None = None


class Checkpointed(BaseModel):
    """``POST /checkpoint``: the oldest checkpoint the trainer may still resume from."""

    oldest_step: int = Field(ge=0, le=MAX_INT)
    """Groups trained at this step or before are in every checkpoint a resume can
    start from: their bodies are released."""


class PolicyVersion(BaseModel):
    version: int = Field(ge=0, le=MAX_INT)
    model: str | None = Field(default=None, min_length=1, max_length=512)
    """The model name the inference servers serve this version under (a LoRA adapter's
    versioned name), when it is not their base model: envs send requests to it."""


class APIConfig(BaseModel):
    """Settings of ``lachesis api``: CLI flags > YAML file (``--config``) > defaults."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    db: Path = Path("runs/api/queue.sqlite")
    """SQLite file holding the queue; ignored with ``in_memory``."""
    in_memory: bool = False
    """Keep everything in memory: faster, but a restart loses the queue."""
    synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """SQLite ``synchronous``: FULL survives power loss, NORMAL only process crashes."""
    token: str | None = Field(default_factory=run_token)
    """Bearer token required on every endpoint but ``/health`` when set (env:
    LACHESIS_API_TOKEN; ``lachesis run`` sets it to the run's token)."""
    max_body_mb: float = Field(default=64.0, gt=0)
    """Largest accepted request body (after gzip decompression), in MiB."""
    lease_timeout_s: float = Field(default=600.0, gt=0)
    """An unacknowledged lease is redelivered after this long. A server restarted with a
    shorter timeout applies it to the leases it resumes too (from the restart)."""
    max_staleness: int | None = Field(default=None, ge=0)
    """Drop groups generated more than this many policy versions ago (None: never)."""
    mix_wait_s: float = Field(default=60.0, ge=0)
    """Batches follow the envs' weights: when the weights owe the next group to an env
    that has none queued, the batch waits for it, at most this long (then the other envs
    fill it and the owed env keeps its credit, up to a batch). Only envs heard from (a
    push, a ``/status-env`` poll, their registration) within the last 10 s are waited
    for, so a dead env holds up a batch 10 s at most. 0: never wait (each batch mixes what
    is queued)."""
    status_env_own_queue: bool = False
    """``/status-env`` answers ``queue_size`` with the env's own queued groups (its
    ``self_queue_size``), not the whole queue's. atroposlib envs stop generating while
    ``queue_size`` holds ``max_batches_offpolicy`` batches: with this they pace on their
    own groups, as lachesis envs do (``max_queued_groups``), so another env's queued batch
    does not stop an env whose groups the weights owe. ``lachesis run`` sets it."""

    @classmethod
    def load(cls, path: str | Path | None, **overrides) -> APIConfig:
        return load_settings(cls, path, "api", overrides)

    @property
    def db_path(self) -> str:
        return ":memory:" if self.in_memory else str(self.db)
