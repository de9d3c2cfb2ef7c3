"""``lachesis train``: the RL (and SFT) training loop, top to bottom.

One step:

1. get a batch: lease ``batch_size`` sequences from the rollout API (acknowledged after
   the step, so a crash mid-step gets them redelivered), or read whole groups from a
   JSONL file (``--data``);
2. check it (the data contract, the model's vocabulary, trainable): a group that fails is
   set aside (logged with its group id and env, counted, and acknowledged to the API as
   a dead letter, so it is never redelivered) and the step trains on the others; compute
   per-token advantages per group with the configured estimator (env-provided
   ``advantages`` win); one row per
   trajectory (per segment, when it has ``segment_starts``), or per assistant turn with
   ``samples: turn_prefix``;
3. at step 0, the alignment check: the trainer's logprobs of the sampled tokens must equal
   vLLM's recorded ones (mean absolute difference below ``alignment_tolerance``);
4. forward/backward over micro-batches (gradients accumulate so the loss is the batch's
   token mean or sequence mean), clip, AdamW step;
5. every ``sync_every`` steps, load the new weights into the vLLM servers in place and
   post the new policy version to the rollout API;
6. log metrics (JSONL, TensorBoard), checkpoint every ``checkpoint_every`` steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
import torch.distributed as dist

from environments.api.client import RejectedGroup
from environments.jsonl_store import read_groups
from environments.trajectory import ScoredGroup
from trainer.advantages import compute_group_advantages
from trainer.batch import (
    BatchError,
    TrainBatch,
    check_group,
    pack,
    segment_samples,
    turn_prefix_samples,
)
from trainer.config import TrainConfig
from trainer.losses import policy_loss, sft_loss, token_logprobs

log = logging.getLogger("lachesis.train")


class AlignmentError(RuntimeError):
    """The trainer's logprobs of the sampled tokens disagree with vLLM's."""


# --------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------
@dataclass
class Batch:
    groups: list[ScoredGroup]
    lease_id: str | None = None
    rejected: list[RejectedGroup] = field(default_factory=list)
    """Groups set aside (they cannot be trained on); acknowledged as dead letters."""


class JSONLBatches:
    """Whole groups from a JSONL file, ``batch_size`` sequences per batch, cycling."""

    def __init__(self, path: Path, batch_size: int):
        self.groups = list(read_groups(path))
        if not self.groups:
            raise BatchError(f"{path}: no groups")
        too_big = [g.group_id for g in self.groups if len(g.trajectories) > batch_size]
        if too_big:
            raise BatchError(f"{path}: group {too_big[0]} has more sequences than batch_size "
                             f"({batch_size})")
        self.batch_size = batch_size
        self.position = 0

    def next(self) -> Batch:
        groups, n = [], 0
        while True:
            group = self.groups[self.position % len(self.groups)]
            if n + len(group.trajectories) > self.batch_size:
                break
            groups.append(group)
            n += len(group.trajectories)
            self.position += 1
        return Batch(groups)


class SFTBatches:
    """SFT examples (messages or groups, see :mod:`trainer.sft_data`), cycling."""

    def __init__(self, path: Path, batch_size: int, tokenizer: Any):
        from environments.inference.chat_template import ChatRenderer
        from trainer.sft_data import read_sft_examples

        self.examples = read_sft_examples(path, ChatRenderer(tokenizer))
        self.batch_size = batch_size
        self.position = 0

    def next_tensors(self, pad_id: int) -> TrainBatch:
        chosen = [self.examples[(self.position + i) % len(self.examples)]
                  for i in range(self.batch_size)]
        self.position += self.batch_size
        return pack(chosen, [[0.0] * len(t.tokens) for t in chosen], pad_id=pad_id,
                    with_logprobs=False)


class APIBatches:
    """Leased batches from the rollout API."""

    def __init__(self, config: TrainConfig):
        from environments.api.client import RolloutAPIClient

        self.client = RolloutAPIClient(config.api_url, config.api_token)
        self.config = config

    async def register(self) -> None:
        await self.client.register_trainer(batch_size=self.config.batch_size,
                                           max_token_len=self.config.max_token_length)

    async def next(self) -> Batch:
        while True:
            leased = await self.client.lease(self.config.batch_size)
            if leased is not None:
                for rejected in leased.rejected:
                    log.error("setting aside %s", rejected)
                return Batch(leased.groups, leased.lease_id, leased.rejected)
            await asyncio.sleep(self.config.lease_poll_s)


# --------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------
def batch_tensors(batch: Batch, config: TrainConfig, vocab_size: int,
                  pad_id: int) -> tuple[TrainBatch | None, dict[str, float]]:
    """Check the batch and turn it into padded tensors with per-token advantages: one row
    per trajectory, or per assistant turn with ``samples: turn_prefix``. Advantages are
    computed per group on whole trajectories; a trajectory with ``segment_starts`` then
    gives one row per segment (per turn within each segment with ``turn_prefix``)."""
    trajectories, advantages = [], []
    dropped = zero_variance = 0
    rewards = []
    env_metrics: dict[str, list[float]] = {}
    trained_groups = []
    for g, group in enumerate(batch.groups):
        where = f"group {g} ({group.group_id}, env {group.env}, item {group.item_id})"
        try:  # one bad group is set aside; the others train
            check_group(group, where, vocab_size=vocab_size, need_logprobs=True)
            result = compute_group_advantages(
                group.trajectories, config.estimator,
                turn_advantage_coef=config.turn_advantage_coef, gamma=config.gamma,
                zero_variance=config.zero_variance)
            group_rows, group_advantages = [], []
            for i, (t, a) in enumerate(zip(group.trajectories,
                                           result.advantages if result else [])):
                if config.samples == "turn_prefix":
                    rows, row_advantages = turn_prefix_samples(t, a, f"{where} sequence {i}")
                elif t.segment_starts:
                    rows, row_advantages = segment_samples(t, a)
                else:
                    rows, row_advantages = [t], [a]
                group_rows += rows
                group_advantages += row_advantages
        except (BatchError, ValueError) as error:
            rejected = RejectedGroup.of(group, str(error))
            log.error("setting aside %s", rejected)
            batch.rejected.append(rejected)
            continue
        trained_groups.append(group)
        rewards += [t.outcome for t in group.trajectories]
        for t in group.trajectories:
            for name, value in (t.metadata.get("metrics") or {}).items():
                env_metrics.setdefault(name, []).append(float(value))
        if result is None:
            dropped += 1
            continue
        zero_variance += result.zero_variance
        trajectories += group_rows
        advantages += group_advantages
    stats = {**({"reward_mean": float(np.mean(rewards))} if rewards else {}),
             "groups": len(trained_groups), "groups_set_aside": len(batch.rejected),
             "groups_zero_variance": zero_variance, "groups_dropped": dropped,
             "rows": len(trajectories),
             "row_tokens": sum(len(t.tokens) for t in trajectories),
             **{f"env/{k}": float(np.mean(v)) for k, v in sorted(env_metrics.items())}}
    versions = [t.policy_version for g in trained_groups for t in g.trajectories
                if t.policy_version is not None]
    if versions:
        stats["rollout_policy_version_min"] = min(versions)
    if not trajectories:
        return None, stats
    return pack(trajectories, advantages, pad_id=pad_id), stats


def sequence_logprobs(model: torch.nn.Module, tokens: torch.Tensor,
                      lengths: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = log p(tokens[b, t] | tokens[b, <t])`` (0 at t = 0 and on padding)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    lengths = lengths.to(tokens.device)
    attention = (positions < lengths[:, None]).long()
    logits = model(input_ids=tokens, attention_mask=attention).logits
    return token_logprobs(logits, tokens)


def alignment_check(model: torch.nn.Module, batch: TrainBatch,
                    micro_batch_size: int) -> float:
    """Mean |trainer logprob - vLLM logprob| over the trained tokens of ``batch``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(batch.lengths), micro_batch_size):
            mb = batch.slice(slice(start, start + micro_batch_size)).to(model.device)
            logprobs = sequence_logprobs(model, mb.tokens, mb.lengths)
            diff = (logprobs.float() - mb.old_logprobs).abs()[mb.mask]
            total += float(diff.sum())
            count += int(mb.mask.sum())
    return total / max(1, count)


def init_distributed() -> tuple[int, int]:
    """``(rank, world_size)``; joins the process group when started by ``torchrun``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank() if world > 1 else 0), world


def uses_fsdp(config: TrainConfig, world: int) -> bool:
    if world == 1:
        return False
    if config.sharding == "auto":
        return torch.cuda.is_available()
    return config.sharding == "fsdp"


def shard_model(model: torch.nn.Module) -> None:
    """FSDP2: shard every transformer block (HF ``_no_split_modules``), then the root.

    FSDP averages gradients over ranks; ``train_step`` scales its losses by the world size
    to turn that back into the sum its weighting needs. (A divide factor of 1 would say it
    directly, but gloo has no PREMUL_SUM reduction.)"""
    from torch.distributed.fsdp import fully_shard

    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer block class "
                         "(_no_split_modules): cannot shard it with FSDP")
    for block in blocks:
        fully_shard(block)
    fully_shard(model)


def full_state_dict(model: torch.nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU. Sharded: a collective every rank must call; rank 0
    gets the weights, the others an empty dict."""
    if not sharded:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model, optimizer, sharded: bool) -> dict[str, Any]:
    """The optimizer state, unsharded (a collective when sharded, as above)."""
    if not sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict[str, Any], sharded: bool) -> None:
    if not sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_optimizer_state_dict)

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


def train_step(model, optimizer, batch: TrainBatch, config: TrainConfig, *,
               ref_model=None, rank: int = 0, world: int = 1,
               sharded: bool = False) -> dict[str, float]:
    """One optimizer step over ``batch`` with gradient accumulation over micro-batches.

    Data parallel: every rank holds the whole batch and trains on sequences
    ``rank, rank + world, ...``; each micro-batch's loss is weighted by its share of the
    *whole* batch's trained tokens (or sequences), so summing the ranks' gradients
    (all-reduce, or FSDP's reduce-scatter) gives exactly the single-process gradient.
    Under FSDP every rank runs the same number of forward/backward passes (each one
    gathers the sharded weights), padding with an empty micro-batch where it has fewer.
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    n_tokens = batch.n_tokens
    n_sequences = int((batch.mask.sum(1) > 0).sum())
    n_rows = len(batch.lengths)
    empty = batch.slice(slice(0, 1))
    empty.mask = torch.zeros_like(empty.mask)
    if world > 1:
        batch = batch.select(list(range(rank, n_rows, world)))
    rows_per_rank = -(-n_rows // world) if sharded else len(batch.lengths)
    totals: dict[str, float] = {}
    for start in range(0, rows_per_rank, config.micro_batch_size):
        mb = batch.slice(slice(start, start + config.micro_batch_size))
        if len(mb.lengths) == 0:
            mb = empty
        mb = mb.to(model.device)
        mb_tokens = int(mb.mask.sum())
        if mb_tokens == 0 and not sharded:
            continue
        logprobs = sequence_logprobs(model, mb.tokens, mb.lengths).float()
        if mb_tokens == 0:  # keeps this rank in step with the others' collectives
            (logprobs.sum() * 0.0).backward()
            continue
        if config.mode == "sft":
            loss, metrics = sft_loss(logprobs, mb.mask), {}
        else:
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref = sequence_logprobs(ref_model, mb.tokens, mb.lengths).float()
            loss, metrics = policy_loss(
                logprobs, mb.old_logprobs, mb.advantages, mb.mask,
                clip_low=config.clip_low, clip_high=config.clip_high, tis_cap=config.tis_cap,
                trainer_old_logprobs=logprobs.detach(), aggregation=config.aggregation,
                ref_logprobs=ref, kl_coef=config.kl_coef)
        # Weight each micro-batch so the accumulated gradient is the batch's mean.
        if config.aggregation == "sequence_mean" and config.mode == "rl":
            weight = int((mb.mask.sum(1) > 0).sum()) / max(1, n_sequences)
        else:
            weight = mb_tokens / n_tokens
        (loss * weight * (world if sharded else 1)).backward()
        totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) * weight
        for key, value in metrics.items():
            if key != "n_tokens":
                totals[key] = totals.get(key, 0.0) + float(value) * mb_tokens / n_tokens
    if world > 1:
        if not sharded:
            for parameter in model.parameters():
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                dist.all_reduce(parameter.grad)
        # A rank with no trained tokens has no metric names: agree on them first.
        names: list[Any] = [None] * world
        dist.all_gather_object(names, sorted(totals))
        keys = sorted(set().union(*names))
        summed = torch.tensor([totals.get(k, 0.0) for k in keys], dtype=torch.float64,
                              device=next(model.parameters()).device)
        dist.all_reduce(summed)
        totals = dict(zip(keys, summed.tolist()))
    if config.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
        totals["grad_norm"] = float(norm)
    optimizer.step()
    totals["trained_tokens"] = n_tokens
    return totals


# --------------------------------------------------------------------------------------
# checkpoints and metrics
# --------------------------------------------------------------------------------------
def save_checkpoint(run_dir: Path, step: int, model, optimizer_state: dict[str, Any], tokenizer,
                    data_position: int = 0, weights: dict[str, torch.Tensor] | None = None
                    ) -> Path:
    """``weights``: a full state dict when the model is sharded (``full_state_dict``)."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer_state, "step": step,
                "data_position": data_position,
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                        "python": random.getstate()}}, tmp / "trainer_state.pt")
    tmp.rename(path)
    return path


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    return found[-1] if found else None


class Progress:
    """A progress bar on a terminal (tqdm); one line per step in logs and pipes."""

    def __init__(self, start: int, total: int):
        import sys

        self.total = total
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, values: dict[str, Any]) -> None:
        fields = {"reward": f"{values.get('reward_mean', float('nan')):.3f}",
                  "loss": f"{values.get('loss', 0.0):.4f}",
                  "kl": f"{values.get('approx_kl', 0.0):.2e}",
                  "clip": f"{values.get('clip_fraction', 0.0):.3f}",
                  "tok/s": f"{values['tokens_per_second']:.0f}"}
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        else:
            print(f"step {step}/{self.total}  " + "  ".join(f"{k} {v}" for k, v in fields.items()),
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Metrics:
    def __init__(self, run_dir: Path, tensorboard: bool, wandb: bool = False,
                 config: dict[str, Any] | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a")
        self.writer = None
        self.wandb = None
        if wandb:
            try:
                import wandb as wandb_module

                self.wandb = wandb_module.init(project="lachesis", dir=str(run_dir),
                                               config=config, resume="allow")
            except ImportError:
                log.warning("wandb is not installed; metrics go to metrics.jsonl only")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed; metrics go to metrics.jsonl only")

    def log(self, step: int, values: dict[str, Any]) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


# --------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------
async def train(config: TrainConfig, *, check_only: bool = False) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.vllm_sync import VLLMWeightSync, WeightSyncError

    rank, world = init_distributed()
    leader = rank == 0
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    run_dir = config.run_dir
    start_step = 0
    checkpoint = latest_checkpoint(run_dir) if config.resume else None
    model_path = str(checkpoint) if checkpoint else config.model
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    sharded = uses_fsdp(config, world)
    if sharded:
        shard_model(model)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vocab_size = model.get_input_embeddings().weight.shape[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                  eps=config.adam_eps, weight_decay=config.weight_decay)
    if checkpoint is not None:
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        load_optimizer_state(model, optimizer, state["optimizer"], sharded)
        start_step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        log.info("resumed from %s (step %d)", checkpoint, start_step)
    ref_model = None
    if config.kl_coef > 0 and config.mode == "rl":
        ref_model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype).to(device).eval()
        if sharded:
            shard_model(ref_model)
    if config.mode == "sft":
        if config.data is None:
            raise ValueError("mode sft needs --data (a messages or groups JSONL)")
        source: Any = SFTBatches(config.data, config.batch_size, tokenizer)
        if checkpoint is not None:
            source.position = state.get("data_position", 0)
    elif config.data is not None:  # every rank reads the same batches
        source = JSONLBatches(config.data, config.batch_size)
        if checkpoint is not None:
            source.position = state.get("data_position", 0)
    else:  # rank 0 leases, the others receive the batch from it
        source = APIBatches(config)
        if leader:
            await source.register()

    if (config.vllm_urls or config.vllm_launch) and config.mode == "rl" \
            and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(
            "vLLM 0.32's in-place reload_weights leaves lm_head stale when input and "
            "output embeddings are tied (measured on the CPU build): train a model with "
            "tie_word_embeddings=false, or sync by restarting vLLM")
    metrics = Metrics(run_dir, config.tensorboard, config.wandb,
                      config.model_dump(mode="json")) if leader else None
    summary: dict[str, Any] = {"start_step": start_step}
    managed = progress = None
    try:
        vllm_urls = list(config.vllm_urls)
        if config.vllm_launch and config.mode == "rl" and leader:
            from trainer.vllm_manager import ManagedVLLM

            managed = ManagedVLLM(config.model, port=config.vllm_port,
                                  max_model_len=config.vllm_max_model_len,
                                  extra_args=config.vllm_args, log_dir=run_dir)
            vllm_urls.append(await asyncio.to_thread(managed.start))
        latest_weights = None
        sync = VLLMWeightSync(vllm_urls, run_dir / "weights") \
            if vllm_urls and config.mode == "rl" and leader else None
        progress = Progress(start_step, config.steps) if leader else None
        for step in range(start_step, config.steps):
            started = time.monotonic()
            if isinstance(source, SFTBatches):
                batch = None
                tensors, stats = source.next_tensors(pad_id), {"reward_mean": 0.0}
            elif isinstance(source, APIBatches):
                batch = await source.next() if leader else None
                if world > 1:
                    shared = [batch]
                    dist.broadcast_object_list(shared, src=0)
                    batch = shared[0]
            else:
                batch = source.next()
            if batch is not None:
                tensors, stats = batch_tensors(batch, config, vocab_size, pad_id)
            if step == start_step == 0 and config.check_alignment and config.mode == "rl" \
                    and tensors is not None:
                model.eval()
                diff = alignment_check(model, tensors, config.micro_batch_size)
                summary["alignment_mean_abs_diff"] = diff
                log.info("alignment check: mean |trainer - vLLM| logprob = %.2e over %d tokens",
                         diff, tensors.n_tokens)
                if diff >= config.alignment_tolerance:
                    raise AlignmentError(
                        f"trainer and vLLM logprobs differ by {diff:.3g} on average "
                        f"(tolerance {config.alignment_tolerance}): tokens, masks or the "
                        "model do not line up")
                if check_only:
                    return summary
            values = dict(stats)
            if tensors is not None:
                values.update(train_step(model, optimizer, tensors, config, ref_model=ref_model,
                                         rank=rank, world=world, sharded=sharded))
            version = step + 1
            syncs = bool(config.vllm_urls or config.vllm_launch) and config.mode == "rl" \
                and (version % config.sync_every == 0 or version == config.steps)
            checkpoints = version % config.checkpoint_every == 0 or version == config.steps
            # Sharded weights are gathered by every rank together; rank 0 receives them.
            weights = full_state_dict(model, sharded) if sharded and (syncs or checkpoints) \
                else None
            optim = optimizer_state(model, optimizer, sharded) if checkpoints else None
            if not leader:  # the leader acks, syncs, logs and checkpoints
                continue
            if isinstance(source, APIBatches) and batch.lease_id is not None:
                await source.client.ack(batch.lease_id, batch.rejected)
            if managed is not None and await asyncio.to_thread(managed.ensure_running,
                                                               latest_weights):
                values["vllm_restarts"] = managed.restarts
            if sync is not None and syncs:
                sync_started = time.monotonic()
                latest_weights = await asyncio.to_thread(sync.save, model, tokenizer, version,
                                                         weights)
                try:
                    await sync.reload(latest_weights)
                except (WeightSyncError, aiohttp.ClientError, asyncio.TimeoutError):
                    # A launched server that died now restarts with the new weights.
                    if managed is None or not await asyncio.to_thread(managed.ensure_running,
                                                                      latest_weights):
                        raise
                    values["vllm_restarts"] = managed.restarts
                values["sync_seconds"] = time.monotonic() - sync_started
                if isinstance(source, APIBatches):
                    await source.client.set_policy_version(version)
            seconds = time.monotonic() - started
            values["step_seconds"] = seconds
            values["tokens_per_second"] = values.get("trained_tokens", 0) / seconds
            metrics.log(version, values)
            progress.update(version, values)
            if checkpoints:
                save_checkpoint(run_dir, version, model, optim, tokenizer,
                                getattr(source, "position", 0), weights)
            summary.update(last_step=version, **{f"last_{k}": v for k, v in values.items()})
    finally:
        if progress is not None:
            progress.close()
        if managed is not None:
            summary["vllm_url"], summary["vllm_restarts"] = managed.url, managed.restarts
            await asyncio.to_thread(managed.stop)
        if metrics is not None:
            metrics.close()
        if isinstance(source, APIBatches):
            await source.client.close()
    return summary
