"""The longest micro-batch, rehearsed before the first step
(``train.rehearse_longest_micro_batch``).

A trainer's memory peaks at its longest micro-batch: every layer's activations of its
tokens are held until backward. Episodes that grow while the policy learns reach that
length late, so a trainer that cannot hold it dies at the step whose batch first gets
there (on a CPU, killed by the kernel's out-of-memory killer), with every step before it
paid for; its restart replays the same batches and dies there again. The rehearsal runs
one forward and backward of the largest micro-batch the config can build, random tokens
every position trained, before the first step: a trainer that cannot hold it fails at its
start, and one that can logs the peak (before the optimizer's state exists: what that
adds is logged beside it). Its gradients are dropped; the weights and the random streams
are as they were.
"""

from __future__ import annotations

import logging
import time

import torch

from trainer.batch import TrainBatch
from trainer.config import TrainConfig
from trainer.logprobs import sequence_logprobs
from trainer.memory import GIB, peak_gib, reset_peak

log = logging.getLogger(__name__)


def memory_advice(packing: bool, max_tokens: int, micro_batch_size: int) -> str:
    """What makes a trainer need less memory, given its micro-batch settings."""
    knob, value = (("max_tokens_per_micro_batch", max_tokens) if packing
                   else ("micro_batch_size", micro_batch_size))
    return f"lower train.{knob} ({value} now) or set train.activation_checkpointing: true"


def longest_micro_batch(config: TrainConfig) -> list[int]:
    """Row lengths of the largest micro-batch ``config``'s batches can be cut into: packed,
    rows of ``max_token_length`` up to the token budget (a row longer than the budget is a
    micro-batch alone), and no more tokens than ``batch_size`` sequences hold (turn-prefix
    rows repeat their prefixes: up to the budget); else ``micro_batch_size`` rows of
    ``max_token_length``, padded to it. It takes ``max_token_length`` for the longest
    sequence (or segment) an env sends: an env whose own limit is longer makes longer
    rows than rehearsed."""
    longest = config.max_token_length
    if not config.packing:
        return [longest] * config.micro_batch_size
    total = max(config.max_tokens_per_micro_batch, longest)
    if config.samples == "sequence":
        total = min(total, config.batch_size * longest)
    return [longest] * (total // longest) + ([total % longest] if total % longest else [])


def rehearse(model: torch.nn.Module, config: TrainConfig, vocab_size: int,
             pad_id: int) -> dict[str, float]:
    """One forward and backward of :func:`longest_micro_batch` (the loss: the mean logprob
    of its tokens, computed as training computes it: packed, chunked), gradients dropped.
    Raises :class:`MemoryError` naming the settings when a GPU cannot hold it (on a CPU
    the kernel kills the process). Returns its rows, tokens, seconds and peak memory."""
    lengths = longest_micro_batch(config)
    device = next(model.parameters()).device
    width = max(lengths)
    with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(vocab_size, (len(lengths), width), generator=generator)
        positions = torch.arange(width)
        length = torch.tensor(lengths)
        inside = positions[None, :] < length[:, None]
        mask = inside & (positions[None, :] > 0)
        zeros = torch.zeros(len(lengths), width)
        mb = TrainBatch(tokens.masked_fill(~inside, pad_id), mask, zeros, zeros.clone(),
                        length).to(device)
        reset_peak(device)
        started = time.monotonic()
        model.train()
        try:
            logprobs = sequence_logprobs(model, mb.tokens, mb.lengths, packing=config.packing,
                                         chunk_size=config.logprob_chunk_size, where=mb.mask)
            (-logprobs[mb.mask].mean()).backward()
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            raise MemoryError(
                f"the trainer cannot hold the longest micro-batch its config can build "
                f"({len(lengths)} rows, {sum(lengths)} tokens) in {device}'s memory: "
                + memory_advice(config.packing, config.max_tokens_per_micro_batch,
                                config.micro_batch_size)) from None
        finally:
            model.zero_grad(set_to_none=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    state = 2 * sum(p.numel() * p.element_size()  # AdamW's two moments (this rank's shard)
                    for p in (q.to_local() if hasattr(q, "to_local") else q for q in trained))
    found = {"rows": len(lengths), "tokens": sum(lengths), "optimizer_state_gib": state / GIB,
             "seconds": time.monotonic() - started,
             "peak_gib": peak_gib(device)}
    log.info("rehearsal: the longest micro-batch this config can build (%d rows, %d tokens) "
             "ran forward and backward in %.1f s; peak memory %.2f GiB (%s), and AdamW's "
             "state adds %.2f GiB from the first step", found["rows"], found["tokens"],
             found["seconds"], found["peak_gib"],
             "allocated by torch" if device.type == "cuda" else "the process's resident set",
             found["optimizer_state_gib"])
    return found
