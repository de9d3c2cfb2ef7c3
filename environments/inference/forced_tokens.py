"""Forced turns: a vLLM logits processor that makes a request's output a given token
sequence while vLLM still reports the policy's own logprobs of those tokens.

A request whose sampling parameters carry ``extra_args: {"lachesis_forced_token_ids":
[ids...]}`` gets exactly those ids (then whatever the stop rules say: end the list with
the end-of-turn id). vLLM computes the logprobs it returns from the model's raw logits,
before logits processors run (``--logprobs-mode raw_logprobs``, its default), so each
forced token's recorded logprob is what the policy gives it, and the trainer's alignment
check (``lachesis train --check``) recomputes the same numbers. Structured outputs
(``structured_outputs: {regex: ...}``) instead mask the logits before the logprobs are
taken: vLLM then reports the constrained distribution's logprobs, which the check
refuses.

What it is for: driving an agent harness through a scripted episode (a tool call it runs,
then an answer) with a random tiny model, so that the whole path (harness, proxy, vLLM,
trainer) is exercised on real tokens (``scripted_turns`` of black-box envs). The tokens
are forced, not sampled: the behaviour policy of such a turn is not the policy whose
logprobs are recorded, so it is for tests and smoke runs, not for learning.

Loaded into every vLLM server of the project's venv through the ``vllm.logits_processors``
entry point (pyproject.toml); requests without the argument pass through untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

EXTRA_ARG = "lachesis_forced_token_ids"


def forced_ids(params: Any) -> list[int] | None:
    ids = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARG)
    return list(ids) if ids else None


class ForcedTokens(LogitsProcessor):
    """Per request in the batch: the ids to force, and its running output (vLLM hands a
    reference to the list it appends to)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        ids = (getattr(sampling_params, "extra_args", None) or {}).get(EXTRA_ARG)
        if ids is not None and not (isinstance(ids, list) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise ValueError(f"extra_args.{EXTRA_ARG}: must be a list of token ids")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.forced: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.forced.pop(index, None)
        for index, params, _, output in batch_update.added:
            ids = forced_ids(params)
            if ids:
                self.forced[index] = (ids, output)
            else:
                self.forced.pop(index, None)
        for a, b, direction in batch_update.moved:
            first, second = self.forced.pop(a, None), self.forced.pop(b, None)
            if first is not None:
                self.forced[b] = first
            if direction == MoveDirectionality.SWAP and second is not None:
                self.forced[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (ids, output) in self.forced.items():
            n = len(output)
            if n < len(ids):
                logits[index] = float("-inf")
                logits[index, ids[n]] = 0.0
        return logits
