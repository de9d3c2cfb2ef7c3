"""Interception-proxy overhead: an agent's turns through the proxy vs. the same turns
generated in-process.

One run, one vLLM server (the tiny local model), both sides back to back, alternating
(proxy, direct, direct, proxy, ...: ``--repeats`` pairs), the prefix cache reset before
each timed run:

  * proxy: ``--rollouts`` conversations, ``--concurrency`` at once, each ``--turns``
    chat-completions requests from the real ``openai`` client (``AsyncOpenAI``, over
    HTTP) to :class:`InterceptionProxy`; after each reply the conversation gets the reply
    and a new user message, as an agent's would. The proxy checks the history, renders the
    continuation, generates token-in/token-out, parses, records and answers.
  * direct: the same conversations with no HTTP, no JSON and no history check: per turn,
    :meth:`VLLMBackend.generate_from` on the token sequence and
    :meth:`ChatRenderer.continuation` for the user message, as the framework's own agent
    loop does.

Every turn samples exactly ``--tokens-per-turn`` tokens (``min_tokens`` and a logit bias
on the end-of-turn token, as in ``rollout_overhead.py``), so both sides ask vLLM for the
same work. The agent's client runs in this process, next to the proxy: on a real run it
is another process (in a sandbox), so the proxy side here also pays the client's CPU.
As in ``rollout_overhead.py``, the script re-runs itself in its own session with a lower
nice value (``--client-nice``): the CPU build of vLLM busy-polls every core, and without it
every socket write of the client may wait tens of ms for a core (measured: 17-21 ms per
``send`` on average), which swamps what is being compared.
Prints tokens/s per run and the proxy/direct ratio per pair and overall.

    python benchmarks/proxy_overhead.py --rollouts 32 --turns 3 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import aiohttp  # noqa: E402
import openai  # noqa: E402
from rollout_overhead import (  # noqa: E402
    _CHILD_MARKER,
    EOS_BIAS,
    SERVED_NAME,
    _die_with_parent,
    _run_in_own_session,
    raise_client_priority,
    reset_prefix_cache,
)

from environments.blackbox.proxy import InterceptionProxy  # noqa: E402
from environments.inference.backends import VLLMBackend  # noqa: E402
from environments.inference.chat_template import ChatRenderer  # noqa: E402
from environments.inference.tool_parsers import get_parser  # noqa: E402
from environments.inference.vllm_client import VLLMServerPool  # noqa: E402
from environments.inference.vllm_process import VLLMProcess  # noqa: E402

START = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Tell me about the sea."}]
FOLLOW_UP = {"role": "user", "content": "Go on."}


async def proxy_run(proxy: InterceptionProxy, args: argparse.Namespace) -> int:
    slots = asyncio.Semaphore(args.concurrency)
    http = openai.DefaultAsyncHttpxClient()

    async def conversation() -> int:
        async with slots:
            rollout = proxy.open_rollout()
            client = openai.AsyncOpenAI(base_url=proxy.base_url(rollout), api_key=rollout.token,
                                        max_retries=0, http_client=http)
            messages = list(START)
            for _ in range(args.turns):
                reply = (await client.chat.completions.create(
                    model=SERVED_NAME, messages=messages)).choices[0].message
                messages += [reply.model_dump(exclude_none=True,
                                              include={"role", "content", "tool_calls"}),
                             FOLLOW_UP]
            state = await proxy.finish_rollout(rollout)
            if state.segment_starts:
                raise RuntimeError("a conversation was split into segments")
            return sum(e - s for s, e in (t.span for t in state.turns))

    try:
        return sum(await asyncio.gather(*(conversation() for _ in range(args.rollouts))))
    finally:
        await http.aclose()


async def direct_run(backend: VLLMBackend, renderer: ChatRenderer,
                     args: argparse.Namespace) -> int:
    slots = asyncio.Semaphore(args.concurrency)

    async def conversation() -> int:
        async with slots:
            tokens = renderer.prompt_ids(START)
            history, sampled = list(START), 0
            for turn in range(args.turns):
                generated = await backend.generate_from(tokens, args.tokens_per_turn)
                tokens = tokens + generated.token_ids
                sampled += len(generated.token_ids)
                history.append({"role": "assistant", "content": generated.text})
                if turn < args.turns - 1:
                    continuation = renderer.continuation(history, [FOLLOW_UP],
                                                         ended_with_eos=generated.ended_with_eos)
                    tokens += continuation.token_ids
                    history.append(FOLLOW_UP)
            return sampled

    return sum(await asyncio.gather(*(conversation() for _ in range(args.rollouts))))


async def bench(args: argparse.Namespace, server: VLLMProcess) -> list[dict]:
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(server.model_dir))
    pool = VLLMServerPool([server.url], SERVED_NAME, timeout_s=300)
    await pool.start()
    sampling = {"temperature": 1.0, "top_p": 1.0, "min_tokens": args.tokens_per_turn - 1,
                "logit_bias": {str(renderer.tokenizer.eos_token_id): EOS_BIAS}}
    backend = VLLMBackend(pool, renderer, sampling)
    proxy = InterceptionProxy(backend, get_parser("hermes"), max_turns=args.turns,
                              max_token_length=4096, max_tokens_per_turn=args.tokens_per_turn,
                              model_name=SERVED_NAME)
    await proxy.start()
    results = []
    try:
        async with aiohttp.ClientSession() as session:
            await direct_run(backend, renderer, argparse.Namespace(
                **{**vars(args), "rollouts": args.concurrency, "turns": 1}))  # warm-up
            for pair in range(1, args.repeats + 1):
                sides = ("proxy", "direct") if pair % 2 else ("direct", "proxy")
                for side in sides:
                    await reset_prefix_cache(session, server.url)
                    started = time.perf_counter()
                    tokens = await (proxy_run(proxy, args) if side == "proxy"
                                    else direct_run(backend, renderer, args))
                    seconds = time.perf_counter() - started
                    results.append({"side": side, "pair": pair, "tokens": tokens,
                                    "seconds": round(seconds, 3),
                                    "tokens_per_s": round(tokens / seconds, 1)})
                    print(f"[{pair}] {side:6s} {tokens} tokens in {seconds:.2f} s = "
                          f"{tokens / seconds:.1f} tokens/s", flush=True)
    finally:
        await proxy.close()
        await pool.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--client-nice", type=int, default=-10,
                        help="nice value of this process (both sides), as in "
                             "rollout_overhead.py: the CPU vLLM server busy-polls every core "
                             "and a client that needs one waits for it; 0: leave it")
    parser.add_argument("--json", metavar="OUT", help="also write the runs as JSON to OUT")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.client_nice and not os.environ.get(_CHILD_MARKER):
        return _run_in_own_session(argv, __file__)
    if os.environ.get(_CHILD_MARKER):
        _die_with_parent()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        from lachesis.tiny_model import make_tiny_model

        model_dir = make_tiny_model(Path(tmp) / SERVED_NAME, seed=0)
        server = VLLMProcess(model_dir, served_model_name=SERVED_NAME, max_model_len=4096,
                             dev_mode=True, log_path=Path(tmp) / "vllm.log")
        server.start()
        try:
            server.wait_ready(timeout=300)
            if args.client_nice:
                print(f"benchmark client (both sides): {raise_client_priority(args.client_nice)}",
                      flush=True)
            results = asyncio.run(bench(args, server))
        finally:
            server.stop()
    ratios = []
    for pair in range(1, args.repeats + 1):
        rate = {r["side"]: r["tokens_per_s"] for r in results if r["pair"] == pair}
        ratios.append(rate["proxy"] / rate["direct"])
        print(f"pair {pair}: proxy/direct = {ratios[-1]:.3f}")
    total = {side: sum(r["tokens"] for r in results if r["side"] == side)
             / sum(r["seconds"] for r in results if r["side"] == side)
             for side in ("proxy", "direct")}
    print(f"overall: proxy {total['proxy']:.1f} tokens/s, direct {total['direct']:.1f} "
          f"tokens/s, ratio {total['proxy'] / total['direct']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results,
                                               "pair_ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
