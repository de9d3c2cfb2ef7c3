"""Where assistant turns come from: vLLM token-in/token-out, or any OpenAI-compatible API.

* :class:`VLLMBackend` (training): the prompt is the rollout's token ids; the sampled ids
  and logprobs are kept exactly as vLLM returned them.
* :class:`OpenAIBackend` (evaluation, SFT data): sends the messages to a chat-completions
  API (the ``openai`` package; any hosted model or a vLLM server). The model's own tokens
  are unknown, so the turn is rendered with the local chat template and tokenized; such
  trajectories have no logprobs and are marked not trainable.

Seeded sampling: inside :func:`sampling_seeds`, each request :class:`VLLMBackend` sends
carries a seed (vLLM's per-request generator), the n-th request the n-th seed of the
stream named by the key. The same key and the same policy give the same tokens, whatever
else the server is sampling at the time (up to the numerics of batching, see
docs/determinism.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
from collections.abc import Iterator
from typing import Any

from environments.inference.chat_template import ChatRenderer
from environments.inference.tool_parsers import get_parser
from environments.inference.vllm_client import FORCED_EXTRA_ARG, VLLMServerPool
from environments.rollout import GeneratedTurn, Rollout


_SEEDS: contextvars.ContextVar[Iterator[int] | None] = contextvars.ContextVar(
    "lachesis_sampling_seeds", default=None)


def seed_stream(key: str) -> Iterator[int]:
    """The seeds of stream ``key``: request n gets the first 63 bits of
    sha256(key/n), so streams of different keys do not overlap in practice."""
    n = 0
    while True:
        yield int.from_bytes(hashlib.sha256(f"{key}/{n}".encode()).digest()[:8], "big") >> 1
        n += 1


@contextlib.contextmanager
def sampling_seeds(key: str | Iterator[int] | None) -> Iterator[None]:
    """Seed the requests of the current task (and the tasks it starts) from ``key``'s
    stream, or go on with a stream taken from another task (:func:`current_seeds`, e.g.
    the interception proxy serving a rollout's agent); None: unseeded."""
    token = _SEEDS.set(seed_stream(key) if isinstance(key, str) else key)
    try:
        yield
    finally:
        _SEEDS.reset(token)


def current_seeds() -> Iterator[int] | None:
    """The seed stream the current task's requests draw from (None: unseeded)."""
    return _SEEDS.get()


def next_sampling_seed() -> int | None:
    stream = _SEEDS.get()
    return None if stream is None else next(stream)


CONSTRAINED = ("structured_outputs", "guided_regex", "guided_json", "guided_grammar",
               "guided_choice", "response_format")
"""Sampling parameters that make vLLM sample from a constrained distribution (structured
outputs: a regex, JSON schema, grammar or choice): vLLM then reports the constrained
distribution's logprobs. A forced turn leaves them out (they would mask its tokens)."""


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

    async def generate_from(self, token_ids: list[int], max_tokens: int, *,
                            forced: list[int] | None = None) -> GeneratedTurn:
        """One assistant turn continuing ``token_ids`` (which end with the generation
        prompt). ``forced``: the turn's token ids, given rather than sampled, with the
        policy's own logprobs recorded (:mod:`environments.inference.forced_tokens`)."""
        seed = next_sampling_seed()
        sampling = self.sampling if seed is None else {**self.sampling, "seed": seed}
        if forced is not None:
            sampling = {k: v for k, v in sampling.items() if k not in CONSTRAINED}
            sampling["extra_args"] = {**sampling.get("extra_args", {}),
                                      FORCED_EXTRA_ARG: list(forced)}
        completion = await self.pool.complete(token_ids, max_tokens=max_tokens,
                                              sampling=sampling)
        return sampled_turn(self.renderer, self.stop_token_ids, completion.token_ids,
                            completion.logprobs, completion.finish_reason,
                            completion.weight_versions)


def sampled_turn(renderer: ChatRenderer, stop_token_ids: set[int], ids: list[int],
                 logprobs: list[float] | None, finish_reason: str,
                 weight_versions: list[tuple[str, int, int]] | None = None) -> GeneratedTurn:
    """The assistant turn of sampled token ids ``ids``, stop token included as the engine
    returns it (vLLM, or an in-process ``generate`` cut after its first stop token). The
    chat template's end-of-turn token ends the turn as the template would; another stop
    id (e.g. <|endoftext|>) stays in the trajectory as sampled, and the end-of-turn token
    follows it as context."""
    stopped = bool(ids) and ids[-1] in stop_token_ids
    ended_with_eos = stopped and ids[-1] == renderer.tokenizer.eos_token_id
    text = renderer.decode(ids[:-1] if stopped else ids)
    return GeneratedTurn(ids, logprobs, text, finish_reason, ended_with_eos,
                         weight_versions=weight_versions)


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
