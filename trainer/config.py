"""Settings of ``lachesis train``: CLI flags > YAML file (``--config``, top level or under
``train:``) > these defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from environments.settings import load_settings, run_token
from trainer.lora import LoraSettings


ALIGNMENT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}
"""``alignment_tolerance``'s default per dtype, for the first batch's check."""
SYNC_CHECK_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.3}
"""... and for the post-sync check, whose 8 tokens follow a prompt of random ids: flat
distributions, large logits, where bfloat16's rounding weighs most (SmolLM2-135M, bf16:
0.096 after the first sync, against 6.7e-3 on the first batch's real episodes)."""


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str
    """HF model directory or name of the policy to train."""
    tokenizer: str | None = None
    """Defaults to ``model``."""
    mode: Literal["rl", "sft"] = "rl"
    # data
    api_url: str | None = "http://127.0.0.1:8000"
    """Rollout API to lease batches from (ignored when ``data`` is set)."""
    api_token: str | None = Field(default_factory=run_token)
    api_timeout_s: float = Field(default=30.0, gt=0)
    """How long one request to the rollout API may take (a ``/lease``: this on top of its
    ``lease_wait_s``) before it counts as unanswered, is logged with the API's address and
    retried; after 11 attempts (about 6 min at the default) the trainer exits and is
    restarted from its checkpoint."""
    data: Path | None = None
    """Train offline from this JSONL (groups for ``rl``; groups or messages for ``sft``)."""
    batch_size: int = Field(default=64, ge=1)
    """Sequences per optimizer step."""
    micro_batch_size: int = Field(default=8, ge=1)
    """Rows per forward/backward when ``packing`` is off; gradients accumulate over the
    batch."""
    packing: bool = True
    """Padding-free micro-batches: rows are concatenated up to
    ``max_tokens_per_micro_batch`` tokens, each attending only to itself
    (``trainer.logprobs``); off: ``micro_batch_size`` right-padded rows."""
    max_tokens_per_micro_batch: int = Field(default=16384, ge=8)
    """Token budget of a packed micro-batch (a longer row is a micro-batch alone)."""
    logprob_chunk_size: int | None = Field(default=1024, ge=1)
    """Tokens per chunk of the output projection and log-softmax, recomputed in backward
    (``trainer.losses.chunked_token_logprobs``); None: full float32 logits."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~1/3 more
    compute); works with FSDP2."""
    release_memory_each_step: bool = True
    """On a CPU, give the memory the allocator holds free back to the kernel after each
    step's update (``trainer.memory.release_freed_memory``); without it a trainer's
    resident set climbs from step to step as micro-batches change shape."""
    rehearse_longest_micro_batch: bool = False
    """Before the first step, run one forward and backward of the largest micro-batch this
    config can build (``trainer.rehearsal``): a trainer that cannot hold it fails at its
    start, not at the step whose episodes first grow that long; the peak is logged."""
    max_token_length: int = Field(default=2048, ge=8)
    steps: int = Field(default=100, ge=1)
    lease_wait_s: float = Field(default=1.0, ge=0, le=60)
    """How long one ``/lease`` waits in the rollout API for the batch to be complete: the
    API answers the moment it is (0: answered at once, and asked again every
    ``lease_poll_s``)."""
    lease_poll_s: float = Field(default=0.05, gt=0)
    """How often the trainer asks the rollout API for its next batch while none is ready,
    where the API does not wait (``lease_wait_s``). Every step waits up to this long after
    its batch is complete: at 0.5 s the quickstart's median step took 1.29 s against 1.02 s
    at 0.05 s (``benchmarks/rl_step_time.py --variants base,poll0.5``)."""
    batch_wait_warning_s: float = Field(default=120.0, gt=0)
    """Waiting this long for a batch logs a warning with the rollout API's reason (e.g. no
    groups queued), and again each time as long again passes: a run whose env servers
    deliver nothing (an inference server refusing them, a crashed env loop) says so."""
    max_batch_wait_s: float | None = Field(default=None, gt=0)
    """End training early, as a normal end, when no trainable batch has come for this
    long (counted from when the trainer began asking for the next batch, across batches
    with nothing to train on, and not before an env server has registered with the
    rollout API: a ``lachesis run`` trainer waits through the "before" evaluation). The
    trainer keeps the last step's weights (synced to vLLM, checkpointed), logs why, writes
    ``run_dir/stopped_early.json`` (``step``, ``steps``, ``waited_s``) and exits 0; the
    run then evaluates as after a full run. The usual cause: the policy collapsed, every
    group scores equal and the env servers drop it (``keep_equal_score_groups: false``),
    so nothing reaches the API. None (the default): wait forever, as a slow env may
    legitimately take long; set it well above the longest step you expect."""
    max_untrainable_batches: int = Field(default=5, ge=1)
    """A batch with no group to train on (all set aside, or all dropped) is not a step:
    the trainer acknowledges it and takes the next. After this many such batches in a
    row it stops with a non-zero exit, saying how many groups were set aside and why."""
    # advantages
    estimator: Literal["grpo", "grpo_merged", "mt_grpo", "turn_rtg", "gigpo",
                       "mt_grpo_unbiased", "turn_rtg_unbiased", "gigpo_unbiased"] = "mt_grpo"
    """Advantage estimator (``trainer.advantages``; docs/training.md). ``gigpo`` needs no
    turn scores: it compares turns that start from the same state (``turn_anchors``). The
    ``*_unbiased`` variants take baselines that do not depend on the trajectory's own
    actions, so they stay unbiased when the policy decides when to stop
    (docs/credit-bias.md)."""
    turn_advantage_coef: float = 1.0
    """MT-GRPO's lambda, turn_rtg's weight on intermediate rewards, GiGPO's omega."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount over turns (turn_rtg, gigpo; the GiGPO paper uses 0.95)."""
    advantage_std_scaling: bool = True
    """Divide group-centred rewards by the group's std; false: centred only (Dr. GRPO)."""
    zero_variance: Literal["zero", "drop"] = "zero"
    samples: Literal["sequence", "turn_prefix"] = "sequence"
    """Training rows: sequence (one per trajectory) or turn_prefix (one per turn).
    ``sequence``: the trajectory, per-token advantages inside it. ``turn_prefix``: row
    ``k`` is the conversation up to the end of assistant turn ``k``, trained on turn
    ``k``'s tokens with the estimator's turn-``k`` advantage
    (``trainer.batch.turn_prefix_samples``). Same trained tokens, each with the
    same logprob and advantage, so with ``token_mean`` the gradient is the same; it
    differs with ``sequence_mean`` (every turn weighs as a sequence). Costs ``sum_k
    end_k`` tokens of forward/backward per trajectory instead of its length (~N times for
    N turns when the prompt dominates); ``micro_batch_size`` counts rows, the packing
    budget their tokens. A trajectory with ``segment_starts`` gives one row per segment
    (per turn within each segment with turn_prefix), its advantages computed on the whole
    trajectory
    (``trainer.batch.segment_samples``); with ``sequence_mean`` each segment weighs as a
    sequence."""
    # DAPO's batch shaping (trainer.shaping)
    dynamic_sampling: bool = False
    """Set aside groups that the configured estimator gives no non-zero advantage (equal
    rewards for GRPO; a group of one trajectory) and take more batches until
    ``batch_size`` sequences have signal (whole groups beyond it are left out)."""
    dynamic_sampling_max_batches: int = Field(default=4, ge=1)
    """At most this many batches per step; then the step trains on what it has."""
    overlong_buffer: int | None = Field(default=None, ge=1)
    """DAPO's soft overlong penalty: the outcome loses up to 1, linearly over the last
    ``overlong_buffer`` sampled tokens before ``overlong_max_tokens``, and 1 beyond (None:
    off)."""
    overlong_max_tokens: int | None = Field(default=None, ge=1)
    """The penalty's limit on sampled tokens (None: each trajectory's generation budget,
    ``max_token_length`` less its tokens that were not sampled: prompt, tool results)."""
    overlong_mask_truncated: bool = False
    """Leave truncated trajectories out of the loss (their rewards still count in their
    group's statistics)."""
    # loss
    clip_low: float = Field(default=0.2, ge=0)
    clip_high: float = Field(default=0.2, ge=0)
    tis_cap: float | None = Field(default=2.0, gt=0)
    """Truncated importance sampling cap for the trainer/vLLM mismatch (None: off)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """KL to the frozen initial model (k3 estimator); 0 loads no reference model."""
    loss: Literal["ppo_clip", "gspo", "gspo_token", "cispo"] = "ppo_clip"
    """Policy objective (``trainer.losses.OBJECTIVES``; docs/training.md): PPO's clipped
    token ratio, GSPO's clipped sequence (or turn) ratio, GSPO-token, or CISPO's clipped,
    detached importance weight. GSPO's paper clips at 3e-4 / 4e-4 (``clip_low`` /
    ``clip_high``); CISPO's at a large ``clip_low`` and ``clip_high`` ~ 0.28."""
    gspo_unit: Literal["sequence", "turn"] = "sequence"
    """GSPO's ratio: one per sequence, or one per assistant turn (a run of trained tokens)."""
    mismatch: Literal["tis", "mis_token", "mis_sequence", "none"] = "tis"
    """Trainer/vLLM mismatch correction: ``tis`` weights tokens by ``min(p/mu, tis_cap)``;
    ``mis_token`` masks tokens whose ``p/mu`` leaves ``[mis_low, mis_high]`` (IcePop);
    ``mis_sequence`` drops rows whose geometric-mean ratio leaves it; ``none``."""
    mis_low: float = Field(default=0.5, gt=0)
    mis_high: float = Field(default=5.0, gt=0)
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """Loss normaliser: all trained tokens; each sequence's tokens, then sequences; or
    ``constant`` (Dr. GRPO): the sum over tokens / (sequences * ``loss_constant``)."""
    loss_constant: int | None = Field(default=None, ge=1)
    """The ``constant`` normaliser's token count (None: ``max_token_length``)."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per epoch over a batch: its rows split into this many mini-batches.
    With more than one step per batch, ``pi_old`` is the trainer's logprobs at the
    batch's start (computed once), and vLLM's mismatch is corrected separately."""
    epochs: int = Field(default=1, ge=1)
    """Passes over each batch (each pass reshuffles the rows into mini-batches)."""
    # optimizer
    lr: float = Field(default=1e-5, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up from lr/warmup_steps to lr over this many steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up: keep ``lr`` (constant), or decay it to ``lr * final_lr_fraction``
    at the last of ``steps``, in a straight line (linear) or along half a cosine (cosine)
    (trainer/schedule.py)."""
    final_lr_fraction: float = Field(default=0.0, ge=0, le=1)
    """The last step's learning rate as a fraction of ``lr`` (linear and cosine only)."""
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(default=1e-8, gt=0)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """``auto``: bfloat16 on a GPU that supports it and on a CPU with AMX-BF16 or
    AVX512-BF16, float32 elsewhere (environments/inference/dtypes.py)."""
    sharding: Literal["auto", "replicate", "fsdp"] = "auto"
    """Under ``torchrun``: ``fsdp`` shards parameters, gradients and optimizer state over
    the ranks (FSDP2 ``fully_shard``); ``replicate`` keeps a full copy per rank and
    all-reduces gradients; ``auto`` is ``fsdp`` on GPU and ``replicate`` on CPU."""
    seed: int = 0
    deterministic: bool = False
    """Only deterministic kernels (``torch.use_deterministic_algorithms``, cuBLAS with a
    fixed workspace): on a GPU the same batches then give the same weights
    (docs/determinism.md). On a CPU the trainer repeats without it."""
    # vLLM weight sync
    vllm_urls: list[str] = Field(default_factory=list)
    """Running vLLM servers (started with VLLM_SERVER_DEV_MODE=1) to sync weights into."""
    vllm_launch: bool = False
    """Start a vLLM server for the model as a subprocess (dev mode), health-check it after
    every step and restart it (with the latest synced weights) if it died."""
    vllm_supervised: bool = False
    """The servers of ``vllm_urls`` are restarted by a supervisor (``lachesis run`` sets
    it): one that fails a sync is left behind instead of stopping the run and loaded with
    the newest weights once it answers again; every sync also keeps a disk copy
    (``run_dir/weights``), which a restarted server starts from."""
    sync_timeout_s: float = Field(default=300.0, gt=0)
    """How long one weight-sync request to a vLLM server may take (pause, a reload of the
    weights from disk, a transfer, resume): a reload of a big model from disk. A server
    that exceeds it misses the sync (supervised: it gets the weights once it answers
    again; its supervisor restarts it if it hangs)."""
    vllm_health_timeout_s: float = Field(default=5.0, gt=0)
    """How long a health check of a vLLM server may take (``/health``: before a sync to a
    server that missed one, and while the trainer waits long for a batch, to name a
    server that does not answer)."""
    vllm_port: int | None = None
    vllm_max_model_len: int = Field(default=4096, ge=16)
    vllm_args: list[str] = Field(default_factory=list)
    """Extra arguments for the launched vLLM server."""
    sync_every: int = Field(default=1, ge=1)
    """Sync weights into vLLM (and post the new policy version) every N steps."""
    sync_pause: Literal["keep", "wait", "abort"] = "keep"
    """How a full-weight sync treats requests running on a server (docs/weight-sync.md):
    ``keep`` freezes them, loads the weights and lets them go on with the new ones (the
    sync does not wait for the longest generation; vLLM 0.32+, else ``wait``); ``wait``
    lets them finish first; ``abort`` ends them and the envs continue them on the new
    weights. Every token keeps the logprob of the weights that sampled it. LoRA syncs
    never pause."""
    sync_stale_kv: bool = False
    """With ``sync_pause: keep``: the frozen requests go on with the key/values the old
    weights computed (and the prefix cache keeps them) instead of recomputing their
    context with the new weights after every sync (PipelineRL's in-flight updates). Saves
    a prefill of every running request's context per sync; the tokens after the update
    are sampled by the new weights over the old weights' keys/values, and keep the
    logprobs they were sampled with (docs/weight-sync.md)."""
    weight_sync: Literal["auto", "transfer", "disk", "lora"] = "auto"
    """How new weights reach vLLM: auto, transfer, disk or lora (docs/weight-sync.md).
    ``disk``: a HF checkpoint that vLLM re-reads; ``transfer``: in memory through vLLM's
    weight-transfer API (servers started with ``--weight-transfer-config``), disk as the
    fallback when a transfer fails; ``lora``: the LoRA adapter (``lora``), hot-loaded
    under a versioned name; ``auto``: ``lora`` with a ``lora`` section, else ``transfer``
    where the servers accept it and ``disk`` where they do not."""
    transfer_backend: Literal["auto", "nccl", "shm", "gloo"] = "auto"
    """The in-memory transfer's backend: auto (nccl on GPU, shm on CPU), shm, gloo, nccl.
    ``shm``: a shared-memory file, for servers on this machine; ``gloo`` reaches CPU
    servers on other machines."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter instead of the full weights (base model frozen)."""
    check_sync: bool = True
    """After the first sync, check every server's logprobs equal the trainer's.
    (8 tokens each samples after a random prompt; ``alignment_tolerance``.)"""
    check_sync_every: bool = False
    """With ``check_sync``: check after every sync, not only the first (metrics
    ``sync_check_mean_abs_diff`` and ``sync_checked_servers`` each step)."""
    # alignment check
    check_alignment: bool = True
    """At step 0, compare the trainer's logprobs of the first batch with vLLM's."""
    alignment_tolerance: float | None = Field(default=None, gt=0)
    """None: 1e-3 in float32 (an off-by-one token or mask shows as O(1)); in bfloat16,
    whose rounding alone leaves 0.7-1.6e-2 between the trainer's CPU kernels and vLLM's
    on real episodes (SmolLM2-135M, docs/packaged-models.md), 5e-2 for the first batch
    and 0.3 for ``check_sync`` (:data:`SYNC_CHECK_TOLERANCE`). Also the bound of
    ``check_sync`` when set."""

    def alignment_bound(self, check: str = "batch") -> float:
        """``alignment_tolerance``, or its default for the dtype the trainer runs in and
        the check (``batch``: the first batch's; ``sync``: the post-sync check's)."""
        if self.alignment_tolerance is not None:
            return self.alignment_tolerance
        import torch

        from environments.inference.dtypes import resolve_dtype

        dtype = resolve_dtype(self.dtype, gpu=torch.cuda.is_available())
        return (SYNC_CHECK_TOLERANCE if check == "sync" else ALIGNMENT_TOLERANCE)[dtype]
    # run
    run_dir: Path = Path("runs/train")
    """Metrics (metrics.jsonl, TensorBoard), checkpoints and synced weights go here."""
    checkpoint_every: int = Field(default=50, ge=1)
    """A crash costs at most the steps since the last checkpoint (docs/fault-tolerance.md)."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Keep the newest N checkpoints (older ones are deleted). Two: a checkpoint damaged
    by a crash mid-write still leaves the one before it to resume from."""
    resume: bool = True
    """Resume from the latest checkpoint in run_dir when there is one (one that does not
    verify is skipped for the one before it); the rollout API is told (``POST /resume``)
    and the vLLM servers get the checkpoint's weights before the first step."""
    tensorboard: bool = True
    wandb: bool = False
    """Also log to Weights & Biases (project "lachesis") when the package is installed."""

    @model_validator(mode="after")
    def _mis_band(self) -> TrainConfig:
        if self.mis_low >= self.mis_high:
            raise ValueError(f"mis_low ({self.mis_low}) must be below mis_high ({self.mis_high})")
        limit = self.overlong_max_tokens or self.max_token_length
        if self.overlong_buffer is not None and self.overlong_buffer > limit:
            raise ValueError(f"overlong_buffer ({self.overlong_buffer}) exceeds the limit "
                             f"({limit}, overlong_max_tokens, else at most max_token_length)")
        if self.mini_batches > self.batch_size:
            raise ValueError(f"mini_batches ({self.mini_batches}) exceeds batch_size "
                             f"({self.batch_size}): a mini-batch needs a sequence")
        return self

    @model_validator(mode="after")
    def _lora_needs_lora_sync(self) -> TrainConfig:
        if self.weight_sync == "lora" and self.lora is None:
            raise ValueError("weight_sync: lora needs a `lora` section (rank, alpha, ...)")
        if self.lora is not None and self.weight_sync not in ("auto", "lora"):
            raise ValueError(f"with `lora`, only the adapter trains: weight_sync must be "
                             f"lora or auto, not {self.weight_sync}")
        return self

    @model_validator(mode="after")
    def _stale_kv_needs_keep(self) -> TrainConfig:
        if self.sync_stale_kv and self.sync_pause != "keep":
            raise ValueError(f"sync_stale_kv keeps the KV of the requests that sync_pause: "
                             f"keep freezes; sync_pause: {self.sync_pause} freezes none: set "
                             "sync_pause: keep, or drop sync_stale_kv")
        return self

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> TrainConfig:
        return load_settings(cls, path, "train", overrides)
