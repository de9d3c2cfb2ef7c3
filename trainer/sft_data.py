"""SFT examples from chat messages: tokens of the rendered conversation, trained on the
assistant turns only.

A line of the JSONL file is ``{"messages": [...], "tools": [...]}`` (``tools`` optional),
or a scored group (its trajectories' own masks are used). For messages, the conversation
is rendered once with the tokenizer's chat template, and each assistant message's
characters are located by rendering the conversation up to it: from the end of
``render(messages[:i], add_generation_prompt=True)`` to the end of the message's content
(the end-of-turn token included, the text the template adds after it excluded). Tokens
whose characters fall inside those ranges are trained. This needs a prefix-preserving
template; one that is not is refused with an error naming the line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from environments.inference.chat_template import ChatRenderer
from environments.jsonl_store import parse_group_line
from environments.trajectory import MASKED, ScoredTrajectory
from trainer.batch import BatchError


def messages_to_trajectory(renderer: ChatRenderer, messages: list[dict[str, Any]],
                           tools: list[dict] | None = None, where: str = "") -> ScoredTrajectory:
    full = renderer.render(messages, tools)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = renderer.render(messages[:i], tools, add_generation_prompt=True) if i else ""
        upto = renderer.render(messages[: i + 1], tools)
        if not (full.startswith(before) and full.startswith(upto)):
            raise BatchError(f"{where}: the chat template is not prefix-preserving for this "
                             f"conversation (message {i}); cannot locate the assistant turns")
        end = len(upto) - len(renderer.after_eos)
        spans.append((len(before), end))
    if not spans:
        raise BatchError(f"{where}: no assistant message to train on")
    encoded = renderer.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    tokens = encoded["input_ids"]
    masks = [MASKED] * len(tokens)
    turn_spans = []
    for s, e in spans:
        inside = [i for i, (a, b) in enumerate(encoded["offset_mapping"])
                  if s <= a and b <= e and b > a and i > 0]
        for i in inside:
            masks[i] = tokens[i]
        if inside:
            turn_spans.append([inside[0], inside[-1] + 1])
    return ScoredTrajectory(tokens=tokens, masks=masks, scores=0.0, turn_spans=turn_spans,
                            messages=messages)


def read_sft_examples(path: str | Path, renderer: ChatRenderer) -> list[ScoredTrajectory]:
    examples = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise BatchError(f"{where}: not JSON ({error})") from None
            if isinstance(record, dict) and "messages" in record and "trajectories" not in record \
                    and "tokens" not in record:
                examples.append(messages_to_trajectory(renderer, record["messages"],
                                                       record.get("tools"), where))
            else:
                try:
                    examples += parse_group_line(line).trajectories
                except ValueError as error:
                    raise BatchError(f"{where}: {error}") from None
    if not examples:
        raise BatchError(f"{path}: no examples")
    return examples
