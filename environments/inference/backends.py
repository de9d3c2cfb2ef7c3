"""Where assistant turns come from: vLLM token-in/token-out, or any OpenAI-compatible API.

* :class:`VLLMBackend` (training): the prompt is the rollout's token ids; the sampled ids
  and logprobs are kept exactly as vLLM returned them.
* :class:`OpenAIBackend` (evaluation, SFT data): sends the messages to a chat-completions
  API (the ``openai`` package; any hosted model or a vLLM server). The model's own tokens
  are unknown, so the turn is rendered with the local chat template and tokenized; such
  trajectories have no logprobs and are marked not trainable.
"""

from __future__ import annotations

import json
from typing import Any

from environments.inference.chat_template import ChatRenderer
from environments.inference.tool_parsers import get_parser
from environments.inference.vllm_client import VLLMServerPool
from environments.rollout import GeneratedTurn, Rollout


class VLLMBackend:
    trainable = True

    def __init__(self, pool: VLLMServerPool, renderer: ChatRenderer,
                 sampling: dict[str, Any] | None = None, stop_token_ids: set[int] | None = None):
        self.pool = pool
        self.renderer = renderer
        self.sampling = dict(sampling or {})
        self.stop_token_ids = stop_token_ids or renderer.stop_token_ids

    async def generate(self, state: Rollout, max_tokens: int) -> GeneratedTurn:
        return await self.generate_from(state.context, max_tokens)

    async def generate_from(self, token_ids: list[int], max_tokens: int) -> GeneratedTurn:
        """One assistant turn continuing ``token_ids`` (which end with the generation
        prompt)."""
        completion = await self.pool.complete(token_ids, max_tokens=max_tokens,
                                              sampling=self.sampling)
        ids = completion.token_ids
        # vLLM includes the stop token in token_ids. The chat template's end-of-turn token
        # ends the turn as the template would; another stop id (e.g. <|endoftext|>) stays
        # in the trajectory as sampled, and the end-of-turn token follows it as context.
        stopped = bool(ids) and ids[-1] in self.stop_token_ids
        ended_with_eos = stopped and ids[-1] == self.renderer.tokenizer.eos_token_id
        text = self.renderer.decode(ids[:-1] if stopped else ids)
        return GeneratedTurn(ids, completion.logprobs, text, completion.finish_reason,
                             ended_with_eos)


class OpenAIBackend:
    trainable = False

    def __init__(self, client: Any, model: str, renderer: ChatRenderer,
                 sampling: dict[str, Any] | None = None):
        """``client``: an ``openai.AsyncOpenAI``."""
        self.client = client
        self.model = model
        self.renderer = renderer
        self.sampling = dict(sampling or {})
        self.hermes = get_parser("hermes")

    async def generate(self, state: Rollout, max_tokens: int) -> GeneratedTurn:
        messages = [{k: v for k, v in m.items() if k != "name" or m["role"] != "tool"}
                    for m in state.messages]
        kwargs = {"tools": state.tools} if state.tools else {}
        response = await self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, **self.sampling,
            **kwargs)
        choice = response.choices[0]
        text = choice.message.content or ""
        # Structured calls become Hermes text, so that one parser reports malformed ones
        # and the rendered turn holds them.
        for call in choice.message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                arguments = call.function.arguments
            text += "<tool_call>\n" + json.dumps(
                {"name": call.function.name, "arguments": arguments}) + "\n</tool_call>"
        # Render the turn with the local template to get its tokens.
        before = self.renderer.render(state.messages, state.tools, add_generation_prompt=True)
        after = self.renderer.render(state.messages + [{"role": "assistant", "content": text}],
                                     state.tools)
        if not after.startswith(before):
            raise ValueError("the local chat template does not render the assistant turn "
                             "after the generation prompt; cannot tokenize OpenAI turns")
        turn_text = after[len(before):].removesuffix(self.renderer.after_eos)
        parsed = self.hermes.parse(text) if choice.message.tool_calls else None
        return GeneratedTurn(self.renderer.encode(turn_text), None, text,
                             choice.finish_reason or "stop", True, parsed=parsed)
