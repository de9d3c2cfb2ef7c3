"""From scored groups to padded training tensors, refusing what cannot be trained on.

Conventions (shared with :func:`trainer.losses.token_logprobs` and the data contract):
position ``t`` of every ``[B, T]`` tensor describes ``tokens[t]``: ``mask[t]`` says
whether it is trained, ``old_logprobs[t]`` is vLLM's logprob of sampling it, and
``advantages[t]`` its advantage. Position 0 is never trained (nothing predicts it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from environments.trajectory import MASKED, ScoredGroup, ScoredTrajectory


class BatchError(ValueError):
    """A batch that must not be trained on; the message names the group and sequence."""


def check_trajectory(t: ScoredTrajectory, where: str, *, vocab_size: int | None = None,
                     need_logprobs: bool = True) -> None:
    """Raise :class:`BatchError` if ``t`` cannot be trained on by the RL loss."""
    n = len(t.tokens)
    if len(t.masks) != n:
        raise BatchError(f"{where}: masks has {len(t.masks)} entries for {n} tokens")
    if need_logprobs:
        if t.inference_logprobs is None:
            raise BatchError(f"{where}: no inference_logprobs (needed for the importance ratio)")
        if len(t.inference_logprobs) != n:
            raise BatchError(f"{where}: inference_logprobs has {len(t.inference_logprobs)} "
                             f"entries for {n} tokens")
        bad = next((i for i, x in enumerate(t.inference_logprobs) if not math.isfinite(x)), None)
        if bad is not None:
            raise BatchError(f"{where}: inference_logprobs[{bad}] is {t.inference_logprobs[bad]}")
    for i, (token, mask) in enumerate(zip(t.tokens, t.masks)):
        if mask != MASKED and mask != token:
            raise BatchError(f"{where}: masks[{i}] is {mask}, neither -100 nor the token {token}")
    if t.masks and t.masks[0] != MASKED:
        raise BatchError(f"{where}: the first token is marked trained; nothing predicts it")
    if vocab_size is not None:
        bad = next((i for i, x in enumerate(t.tokens) if not 0 <= x < vocab_size), None)
        if bad is not None:
            raise BatchError(f"{where}: tokens[{bad}] = {t.tokens[bad]} is outside the "
                             f"model's vocabulary ({vocab_size})")
    if t.advantages is not None:
        bad = next((i for i, x in enumerate(t.advantages) if not math.isfinite(x)), None)
        if bad is not None:
            raise BatchError(f"{where}: advantages[{bad}] is {t.advantages[bad]}")
    scores = t.scores if isinstance(t.scores, list) else [t.scores]
    if not all(math.isfinite(s) for s in scores):
        raise BatchError(f"{where}: non-finite score {t.scores}")


def check_groups(groups: list[ScoredGroup], *, vocab_size: int | None = None,
                 need_logprobs: bool = True) -> None:
    for g, group in enumerate(groups):
        for i, t in enumerate(group.trajectories):
            where = f"group {g} ({group.group_id}, item {group.item_id}) sequence {i}"
            if not t.flags.trainable and need_logprobs:
                raise BatchError(f"{where}: marked not trainable (not sampled by the policy)")
            check_trajectory(t, where, vocab_size=vocab_size, need_logprobs=need_logprobs)


@dataclass
class TrainBatch:
    tokens: torch.Tensor        # [B, T] long, right-padded with pad_id
    mask: torch.Tensor          # [B, T] bool, trained positions
    old_logprobs: torch.Tensor  # [B, T] float32, vLLM's; 0 where not trained
    advantages: torch.Tensor    # [B, T] float32; 0 where not trained
    lengths: torch.Tensor       # [B] long

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(self.tokens.to(device), self.mask.to(device),
                          self.old_logprobs.to(device), self.advantages.to(device),
                          self.lengths.to(device))

    def select(self, rows: list[int]) -> TrainBatch:
        """The sequences ``rows`` (e.g. one data-parallel rank's share)."""
        index = torch.tensor(rows, dtype=torch.long)
        lengths = self.lengths[index]
        width = int(lengths.max()) if len(lengths) else 0
        return TrainBatch(self.tokens[index, :width], self.mask[index, :width],
                          self.old_logprobs[index, :width], self.advantages[index, :width],
                          lengths)

    def slice(self, rows: slice) -> TrainBatch:
        lengths = self.lengths[rows]
        width = int(lengths.max()) if len(lengths) else 0
        return TrainBatch(self.tokens[rows, :width], self.mask[rows, :width],
                          self.old_logprobs[rows, :width], self.advantages[rows, :width],
                          lengths)


def pack(trajectories: list[ScoredTrajectory], advantages: list, *, pad_id: int = 0,
         with_logprobs: bool = True) -> TrainBatch:
    """Right-pad trajectories into one :class:`TrainBatch` (``advantages``: per-token arrays)."""
    width = max(len(t.tokens) for t in trajectories)
    b = len(trajectories)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.bool)
    old = torch.zeros((b, width), dtype=torch.float32)
    adv = torch.zeros((b, width), dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, (t, a) in enumerate(zip(trajectories, advantages)):
        n = len(t.tokens)
        lengths[i] = n
        tokens[i, :n] = torch.tensor(t.tokens)
        mask[i, :n] = torch.tensor([m != MASKED for m in t.masks])
        if with_logprobs and t.inference_logprobs is not None:
            old[i, :n] = torch.tensor(t.inference_logprobs, dtype=torch.float32)
        adv[i, :n] = torch.as_tensor(a, dtype=torch.float32)
    old = torch.where(mask, old, torch.zeros_like(old))
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    return TrainBatch(tokens, mask, old, adv, lengths)
