"""Render chat messages to token ids locally, and extend a token sequence turn by turn.

The agent loop never re-tokenizes what the model sampled. A trajectory's tokens are built
by appending, in order:

1. the prompt: ``render(messages, add_generation_prompt=True)``, tokenized once;
2. the sampled ids of an assistant turn, exactly as vLLM returned them;
3. the *continuation* of the new tool/user messages: the text the chat template puts
   after the assistant turn (e.g. ``"\\n"`` after ``<|im_end|>``, or the whole
   ``<|im_end|>\\n`` when the model stopped on a stop string), then the new messages
   and the next generation prompt;
4. again 2 and 3, until the episode ends.

How the continuation is found. Let H be the conversation so far (ending with the
assistant turn) and N the new messages. If the template is *prefix-preserving* for this
conversation, ``render(H)`` is a prefix of ``render(H + N, add_generation_prompt=True)``
and the continuation is the rest. Some templates are not (Qwen3 drops the ``<think>``
blocks of earlier turns once a new user message arrives; others re-number or re-render
history). Then the history already in the token sequence is left exactly as the model saw
it, and the new messages are rendered after a fixed anchor conversation
(``[user, assistant]``, same tools): the continuation is
``render(anchor + N)[len(render(anchor)):]``. This keeps every sampled token and its
logprob valid; the price is that the final token sequence is not what
``render(full conversation)`` would give for such a template: it is what the model saw.
Each rollout records whether every step was prefix-preserving, so this is visible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from environments.inference.tokenizer import generation_eos_ids

_ANCHOR_USER = "\u2063anchor-user\u2063"
_ANCHOR_ASSISTANT = "\u2063anchor-assistant\u2063"


class ChatTemplateError(ValueError):
    """The chat template cannot be used for incremental token-in/token-out rollouts."""


@dataclass
class Continuation:
    token_ids: list[int]
    text: str
    prefix_preserving: bool
    """True when ``render(history)`` was a prefix of ``render(history + new)``."""


class ChatRenderer:
    """A HF tokenizer's chat template, used for token-in/token-out rollouts.

    ``tokenizer`` is a ``transformers`` tokenizer with a chat template and an
    ``eos_token`` (the end-of-turn token the model samples, e.g. ``<|im_end|>``).
    """

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        if tokenizer.eos_token is None:
            raise ChatTemplateError(f"tokenizer {tokenizer.name_or_path!r} has no eos token")
        self.tokenizer = tokenizer
        self.eos_text: str = tokenizer.eos_token
        # the model's generation_config eos ids too: vLLM stops on these
        self.stop_token_ids: set[int] = {tokenizer.eos_token_id,
                                         *generation_eos_ids(tokenizer.name_or_path)}
        self.after_eos = self._text_after_end_of_turn()
        self._last_prompt: tuple[str, list[int]] | None = None

    # -- rendering ---------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        """The template's text; :class:`ChatTemplateError` when the template refuses the
        messages (its ``raise_exception``, or a Jinja error on odd input)."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except Exception as error:
            import jinja2  # the templates' engine (transformers needs it to render them)

            if isinstance(error, jinja2.TemplateError):
                raise ChatTemplateError(f"the chat template cannot render these messages: "
                                        f"{error}") from error
            raise

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation so far plus the generation prompt.

        The last prompt is cached: the ``group_size`` rollouts of an item share it."""
        key = json.dumps([messages, tools], sort_keys=True, default=str)
        if self._last_prompt is None or self._last_prompt[0] != key:
            ids = self.encode(self.render(messages, tools, add_generation_prompt=True))
            self._last_prompt = (key, ids)
        return list(self._last_prompt[1])

    def _text_after_end_of_turn(self) -> str:
        """What the template writes after an assistant turn's end-of-turn token."""
        text = self.render([{"role": "user", "content": _ANCHOR_USER},
                            {"role": "assistant", "content": _ANCHOR_ASSISTANT}])
        marker = _ANCHOR_ASSISTANT + self.eos_text
        at = text.rfind(marker)
        if at < 0:
            raise ChatTemplateError(
                f"the chat template does not end an assistant turn with the eos token "
                f"{self.eos_text!r}; token-in/token-out rollouts need it to")
        return text[at + len(marker):]

    # -- continuing a rollout ----------------------------------------------------------
    def continuation(self, history: list[dict], new_messages: list[dict],
                     tools: list[dict] | None = None, *, ended_with_eos: bool) -> Continuation:
        """Tokens to append after the last sampled assistant turn of ``history``.

        ``ended_with_eos``: whether the sampled ids end with the end-of-turn token. If not
        (a stop string ended the turn), the end-of-turn text is part of the continuation,
        as context: it is not trained, because the model did not sample it.
        """
        if not history or history[-1].get("role") != "assistant":
            raise ChatTemplateError("continuation() needs a history ending with the assistant turn")
        before = self.render(history, tools)
        after = self.render(history + new_messages, tools, add_generation_prompt=True)
        if after.startswith(before) and before.endswith(self.eos_text + self.after_eos):
            text, preserving = after[len(before):], True
        else:
            anchor = [{"role": "user", "content": _ANCHOR_USER},
                      {"role": "assistant", "content": _ANCHOR_ASSISTANT}]
            before = self.render(anchor, tools)
            after = self.render(anchor + new_messages, tools, add_generation_prompt=True)
            if not after.startswith(before):
                raise ChatTemplateError(
                    "the chat template renders new messages differently depending on the "
                    "conversation before them; tokens cannot be appended incrementally")
            text, preserving = after[len(before):], False
        bridge = self.after_eos if ended_with_eos else self.eos_text + self.after_eos
        text = bridge + text
        return Continuation(self.encode(text), text, preserving)
