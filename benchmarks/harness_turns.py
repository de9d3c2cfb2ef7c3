"""Prefix caching on agent-harness episodes: what a turn after the first costs with vLLM's
prefix cache and without it, on the requests the harnesses really send.

A harness re-sends its whole history every turn (system prompt, tool schemas, the
conversation): 1.4k-18k tokens for a first request with a tokenizer learned on harness
text (4x more byte-level; docs/harnesses.md). With prefix caching vLLM prefills only what
is new. This replays each harness's captured two-turn episode
(tests/fixtures/harness_requests/<harness>/: its first call, then its call after the tool
result, exactly as the harness sent them) through the real interception proxy to one vLLM
server, the proxy's first reply scripted to be the tool call the capture got (so the second
call extends the recorded conversation, as in a real episode), and for each repeat runs the
episode twice, alternating: ``cached`` (the prefix cache as vLLM keeps it) and ``reset``
(the cache emptied before every call: no caching). The cache is emptied before each
episode's first call in both, so the first calls are cold alike. Per harness it prints the
second call's prompt tokens, the prefix-cache hit rate on it (vLLM's
``prefix_cache_hits`` / ``prefix_cache_queries`` counters over that call) and its median
seconds in each mode, with the ratio.

    python benchmarks/harness_turns.py                     # all harnesses, 3 repeats
    python benchmarks/harness_turns.py --harness claude-code codex --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import aiohttp  # noqa: E402
from rollout_overhead import reset_prefix_cache  # noqa: E402

from environments.blackbox.proxy import DIALECTS, InterceptionProxy  # noqa: E402
from environments.blackbox.recorder import InterceptedRollout  # noqa: E402
from environments.inference.backends import VLLMBackend  # noqa: E402
from environments.inference.chat_template import ChatRenderer  # noqa: E402
from environments.inference.tool_parsers import get_parser  # noqa: E402
from environments.inference.vllm_client import VLLMServerPool  # noqa: E402
from environments.inference.vllm_process import VLLMProcess  # noqa: E402

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "harness_requests"
HARNESSES = ("pi", "opencode", "codex", "claude-code", "mini-swe-agent",
             "openai-agents-responses")


def episode(harness: str) -> tuple[list[tuple[str, dict]], str]:
    """The harness's first two model calls ``(path, body)`` and the scripted first reply:
    the tool call its second call sends back (Hermes format)."""
    def dialect(path: str):
        return next((d for d in DIALECTS if d.matches(path)), None)

    calls = []
    for file in sorted((FIXTURES / harness).glob("*.json")):
        request = json.loads(file.read_text())
        if request["method"] == "POST" and dialect(request["path"]) is not None:
            calls.append((request["path"], request["body"]))
    first, second = calls[:2]
    turn = dialect(second[0]).parse(json.dumps(second[1]).encode(),
                                    InterceptedRollout("r", "t", None))
    n = len(dialect(first[0]).parse(json.dumps(first[1]).encode(),
                                    InterceptedRollout("r", "t", None)).messages)
    [call] = turn.messages[n].rendered["tool_calls"]
    script = "<tool_call>\n" + json.dumps({"name": call["function"]["name"],
                                           "arguments": call["function"]["arguments"]}) \
        + "\n</tool_call>"
    return [first, second], script


async def counters(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """vLLM's prefix-cache (hits, queries) token counters."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    values = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for name in values:
            if line.startswith(f"vllm:prefix_cache_{name}_total"):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values["hits"], values["queries"]


async def run_episode(http, proxy: InterceptionProxy, server_url: str, calls, mode: str
                      ) -> dict:
    rollout = proxy.open_rollout()
    headers = {"Authorization": f"Bearer {rollout.token}", "x-api-key": rollout.token,
               "x-goog-api-key": rollout.token}
    out = {}
    for i, (path, body) in enumerate(calls):
        if i == 0 or mode == "reset":
            await reset_prefix_cache(http, server_url)
        hits, queries = await counters(http, server_url)
        started = time.perf_counter()
        async with http.post(f"{proxy.url}/rollout/{rollout.id}{path}", json=body,
                             headers=headers) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"call {i + 1} answered {response.status}: "
                                   f"{(await response.text())[:500]}")
        seconds = time.perf_counter() - started
        hits2, queries2 = await counters(http, server_url)
        out[i] = {"seconds": seconds, "hit_rate": (hits2 - hits) / max(queries2 - queries, 1)}
    state = await proxy.finish_rollout(rollout)
    if state.segment_starts:
        raise RuntimeError(f"the second call did not extend the first: {state.extra['segments']}")
    out["prompt_tokens"] = state.turns[1].span[0]
    return out


async def measure(model_dir: Path, harnesses: list[str], repeats: int, max_len: int) -> None:
    from transformers import AutoTokenizer

    with VLLMProcess(model_dir, max_model_len=max_len, dev_mode=True, kv_cache_space_gib=2,
                     served_model_name="tiny") as server:
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
        pool = VLLMServerPool([server.url], "tiny")
        await pool.start()
        print(f"| harness | 2nd call's prompt tokens | hit rate (cached) | s (cached) | "
              f"s (reset) | reset / cached |\n|---|---|---|---|---|---|", flush=True)
        async with aiohttp.ClientSession() as http:
            for harness in harnesses:
                calls, script = episode(harness)
                proxy = InterceptionProxy(
                    VLLMBackend(pool, renderer, {"temperature": 1.0}), get_parser("hermes"),
                    max_turns=8, max_token_length=max_len - 64, max_tokens_per_turn=32,
                    model_name="tiny", scripted_turns=[script, "done"])
                await proxy.start()
                runs = {"cached": [], "reset": []}
                for r in range(repeats):
                    for mode in (("cached", "reset") if r % 2 == 0 else ("reset", "cached")):
                        runs[mode].append(await run_episode(http, proxy, server.url, calls, mode))
                await proxy.close()
                cached = statistics.median(x[1]["seconds"] for x in runs["cached"])
                uncached = statistics.median(x[1]["seconds"] for x in runs["reset"])
                hit = statistics.median(x[1]["hit_rate"] for x in runs["cached"])
                print(f"| {harness} | {runs['cached'][0]['prompt_tokens']} | {hit:.3f} | "
                      f"{cached:.2f} | {uncached:.2f} | {uncached / cached:.1f}x |", flush=True)
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", nargs="+", default=list(HARNESSES), choices=HARNESSES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a model dir (default: a tiny model with "
                        "a tokenizer learned on the fixtures, built here)")
    parser.add_argument("--max-model-len", type=int, default=32768)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = args.model
    if model is None:
        from lachesis.tiny_model import make_tiny_model

        model = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", tied=True,
                                tokenizer="corpus", corpus=[FIXTURES], vocab_size=8192,
                                max_position_embeddings=args.max_model_len)
    asyncio.run(measure(model, args.harness, args.repeats, args.max_model_len))


if __name__ == "__main__":
    main()
