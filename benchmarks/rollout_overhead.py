"""Rollout overhead: env rollouts through the framework vs. raw /v1/completions calls.

One run, one vLLM server (the tiny local model), both sides measured back to back:

  * framework: an env defined here (``EchoBenchEnv``, a ``BaseEnv``) runs the real
    multi-turn agent loop (``BaseEnv.run_groups`` -> ``collect_group`` ->
    ``run_agent_loop`` -> ``VLLMBackend`` -> ``VLLMServerPool``) for ``--groups`` groups
    of ``--group-size`` rollouts, ``--concurrency`` rollouts in flight, delivered to an
    in-memory delivery. A benchmark tool-call parser (registered with
    ``register_parser``) reads every assistant turn as one call to a trivial ``echo``
    tool, so every episode has exactly ``--turns`` assistant turns with a tool result
    between two turns: sampling, decoding, parsing, tool execution, continuation
    rendering and token bookkeeping all run, every turn.
  * raw: the very same requests, without any framework code: for every turn of every
    trajectory the framework produced, one ``POST /v1/completions`` (same sampling
    parameters, ``logprobs: 0``, ``return_token_ids: true``) from plain aiohttp, with
    ``--concurrency`` workers; a worker runs one trajectory's turns one after the other
    (turn k only after turn k-1), like the framework does. Its prompt has the length
    of the framework's: by default (``--raw-prompts own``) the worker's own previous
    prompt + its own sampled ids + the framework's recorded tool-result tokens, so the
    server does the same prefill work and gets the same prefix-cache hits as for the
    framework; ``--raw-prompts recorded`` sends the framework's tokens[:span_start]
    instead (the server then prefills the framework's sampled tokens again, which
    makes raw a little slower).

Every turn samples exactly ``--tokens-per-turn`` tokens, the last being the end-of-turn
token: ``min_tokens = N - 1`` forbids the stop tokens before that, and a +100 logit bias
on the end-of-turn token makes it the N-th token. (``ignore_eos`` + ``max_tokens`` would
fix the count too, but the turn would end with finish_reason "length", which the agent
loop rightly treats as truncation: the episode would stop after one turn.) Both sides
send the same sampling parameters, so the server does the same work.

The sides alternate (framework, raw, raw, framework, framework, raw, ...: ``--repeats``
pairs) and the prefix cache is reset before each timed run. The script prints a table
(side | tokens | seconds | tokens/s, plus the mean number of requests in flight and
the CPU used by this client, by the vLLM server and by anything else on the machine),
the framework/raw ratio per pair and overall, and whether the target (framework >=
0.90 x raw) is met. ``--json OUT`` writes the numbers. The only instrumentation of the
framework side is a timer around ``VLLMServerPool.complete`` (for "in flight").

Client priority (``--client-nice``, default -10). The CPU build of vLLM busy-polls
(its engine core and worker spin on shared-memory queues), so on a small machine the
server keeps every core busy, and a client process that needs the CPU for a moment
waits for one, often for tens of ms and sometimes for seconds. That waiting, not the
client's own work, then dominates both sides (and the framework more, since it needs
the CPU more often per turn). The script therefore re-runs itself in a new session,
so in its own scheduler autogroup, and lowers that group's and its threads' nice value
(both sides run in this one process, so both get it; the server keeps its own); as if
the env had a core of its own, as it would next to a GPU server. ``--client-nice 0``
leaves the scheduler alone. Lowering a nice value needs root or CAP_SYS_NICE; without
it the run goes on and says so.

Run from the repo root with the project's Python (vllm, torch, transformers):
    .venv/bin/python benchmarks/rollout_overhead.py
    .venv/bin/python benchmarks/rollout_overhead.py --groups 8 --repeats 4 --json out.json
    .venv/bin/python benchmarks/rollout_overhead.py --client-nice 0    # no priority
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from environments import BaseEnv, EnvConfig, tool  # noqa: E402
from environments.inference.tool_parsers import (  # noqa: E402
    ParsedToolCall,
    ParsedTurn,
    ToolCallParser,
    register_parser,
)
from environments.inference.vllm_process import VLLMProcess  # noqa: E402
from lachesis.run.processes import tree_cpu_seconds  # noqa: E402

TARGET_RATIO = 0.90
SERVED_NAME = "tiny"
PARSER_NAME = "bench-echo-every-turn"
EOS_BIAS = 100.0  # vLLM clamps logit biases to [-100, 100]
DISTURBED_CORES = 0.1  # other processes' CPU (in cores) above which a pair is flagged


# --------------------------------------------------------------------------- #
# The benchmark env
# --------------------------------------------------------------------------- #


@tool
def echo(text: str) -> str:
    """Echo a short summary of the text.

    Args:
        text: any text.
    """
    return f"echoed {len(text)} characters"


@tool(name="echo", inline=True)
def inline_echo(text: str) -> str:
    """Echo a short summary of the text.

    Args:
        text: any text.
    """
    return f"echoed {len(text)} characters"


@tool(name="echo")
async def async_echo(text: str) -> str:
    """Echo a short summary of the text.

    Args:
        text: any text.
    """
    return f"echoed {len(text)} characters"


@register_parser(PARSER_NAME)
class EchoEveryTurnParser(ToolCallParser):
    """Reads every assistant turn as exactly one call ``echo(text=<the turn's first 16
    characters>)``: a random model then still runs full multi-turn episodes."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(content=text, calls=[
            ParsedToolCall(name="echo", arguments={"text": text[:16]}, raw="")])


class EchoBenchEnv(BaseEnv):
    """Short prompt, one trivial tool, a constant scalar reward."""

    name = "rollout_overhead_bench"
    tools = [echo]

    def __init__(self, config: EnvConfig, *, tool_kind: str = "inline"):
        super().__init__(config)
        self._next = 0
        self.echo = {"inline": inline_echo, "sync": echo, "async": async_echo}[tool_kind]

    def get_tools(self, item: Any) -> list:
        return [self.echo]

    async def get_next_item(self) -> dict[str, Any]:
        self._next += 1
        return {"id": f"item-{self._next}"}

    def prompt_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"Call echo, then again ({item['id']})."}]

    def compute_reward(self, item: Any, rollout: Any) -> float:
        return float(rollout.tool_calls)


def timed_requests(pool: Any) -> None:
    """Add the wall time of each completion request to ``pool.request_seconds[0]``
    (two clock reads per request: the only instrumentation of the framework side). The
    sum over a run / its wall time is the mean number of requests in flight."""
    complete = pool.complete
    pool.request_seconds = [0.0]

    async def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await complete(*args, **kwargs)
        finally:
            pool.request_seconds[0] += time.perf_counter() - started

    pool.complete = timed


class MemoryDelivery:
    """Keeps the delivered groups."""

    def __init__(self) -> None:
        self.groups: list[Any] = []

    async def send(self, group: Any) -> None:
        self.groups.append(group)


# --------------------------------------------------------------------------- #
# Measurements
# --------------------------------------------------------------------------- #


@dataclass
class RunResult:
    side: str  # "framework" or "raw"
    pair: int
    tokens: int
    seconds: float
    requests: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Workload:
    """The framework's trajectories, as the raw side replays them."""

    trajectories: list[tuple[list[int], list[tuple[int, int]]]]  # (tokens, turn spans)

    @property
    def tokens(self) -> int:
        return sum(e - b for _, spans in self.trajectories for b, e in spans)

    @property
    def requests(self) -> int:
        return sum(len(spans) for _, spans in self.trajectories)


def sampling_params(args: argparse.Namespace, eos_token_id: int) -> dict[str, Any]:
    return {"temperature": args.temperature, "top_p": 1.0,
            "min_tokens": args.tokens_per_turn - 1,
            "logit_bias": {str(eos_token_id): EOS_BIAS}}


class CPUClock:
    """CPU seconds used by this process and by the vLLM server's process tree."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid

    def read(self) -> tuple[float, float, float]:
        return time.process_time(), tree_cpu_seconds(self.server_pid), _machine_busy_seconds()

    def since(self, before: tuple[float, float, float]) -> dict[str, float]:
        client, server, machine = (b - a for a, b in zip(before, self.read()))
        return {"client_cpu_s": client, "server_cpu_s": server,
                "other_cpu_s": max(0.0, machine - client - server)}


def _machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


async def reset_prefix_cache(session: aiohttp.ClientSession, url: str) -> None:
    for _ in range(50):  # fails while requests hold blocks; none should be running
        async with session.post(url + "/reset_prefix_cache") as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                raise RuntimeError(f"POST /reset_prefix_cache answered {response.status}: "
                                   f"{body}")
            if body is None or body.get("success", True):
                return
        await asyncio.sleep(0.1)
    raise RuntimeError("the prefix cache could not be reset")


async def framework_run(env: EchoBenchEnv, args: argparse.Namespace, pair: int,
                        groups: int | None = None) -> tuple[RunResult, Workload]:
    stats_before = dict(env.describe_stats())
    pool_tokens_before = env._pool.stats.completion_tokens
    retries_before = env._pool.stats.retries
    delivery = MemoryDelivery()
    busy = env._pool.request_seconds = [0.0]  # see timed_requests()
    gc.collect()
    started = time.perf_counter()
    await env.run_groups(delivery, groups or args.groups)
    seconds = time.perf_counter() - started

    trajectories = [(list(t.tokens), [tuple(s) for s in t.turn_spans])
                    for g in delivery.groups for t in g.trajectories]
    workload = Workload(trajectories)
    problems = []
    for g in delivery.groups:
        for t in g.trajectories:
            lengths = [e - b for b, e in t.turn_spans]
            if lengths != [args.tokens_per_turn] * args.turns:
                problems.append(f"turn lengths {lengths}")
            if t.flags.tool_errors or t.metadata.get("stop") != "max_turns":
                problems.append(f"stop {t.metadata.get('stop')!r}, "
                                f"{t.flags.tool_errors} tool errors")
    if problems:
        raise RuntimeError(f"{len(problems)} framework episodes are not {args.turns} turns of "
                           f"{args.tokens_per_turn} tokens with a tool call between turns; "
                           f"first: {problems[0]}")
    stats = env.describe_stats()
    delta = {k: stats[k] - stats_before.get(k, 0) for k in stats if isinstance(stats[k], int)}
    extra = {
        "groups": len(delivery.groups),
        "trajectories": len(trajectories),
        "tool_calls_run": sum(1 for g in delivery.groups for t in g.trajectories
                              for m in t.messages if m.role == "tool"),
        # tokens of every completed request, and of every completed group, including
        # groups collected past --groups and dropped (run_groups' tail)
        "all_completed_request_tokens": env._pool.stats.completion_tokens - pool_tokens_before,
        "all_completed_group_tokens": delta["sampled_tokens"],
        "max_trajectory_tokens": max(len(tokens) for tokens, _ in trajectories),
        "mean_in_flight": busy[0] / seconds,
        "retries": env._pool.stats.retries - retries_before,
    }
    return RunResult("framework", pair, workload.tokens, seconds, workload.requests,
                     extra), workload


async def raw_run(session: aiohttp.ClientSession, url: str, workload: Workload,
                  sampling: dict[str, Any], args: argparse.Namespace,
                  pair: int) -> RunResult:
    """Replay the workload's turns as plain /v1/completions calls."""
    queue = iter(workload.trajectories)
    counted = [0]
    busy = [0.0]
    retries = [0]
    mismatches: list[str] = []

    async def complete(prompt: list[int], max_tokens: int) -> list[int]:
        payload = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                   **sampling, "logprobs": 0, "return_token_ids": True, "n": 1,
                   "stream": False}
        started = time.perf_counter()
        for attempt in range(2):
            try:
                async with session.post(url + "/v1/completions", json=payload) as response:
                    data = await response.json(content_type=None)
                    if response.status != 200:
                        raise RuntimeError(f"/v1/completions answered {response.status}: {data}")
                break
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                # a kept-alive connection the server closed (uvicorn: after 5 s idle) just
                # as it was reused; retry at once on a new one
                if attempt:
                    raise
                retries[0] += 1
        busy[0] += time.perf_counter() - started
        return data["choices"][0]["token_ids"]

    async def worker() -> None:
        for tokens, spans in queue:  # shared iterator: each trajectory is replayed once
            prompt = tokens[:spans[0][0]]
            for k, (start, end) in enumerate(spans):
                if args.raw_prompts == "recorded":
                    prompt = tokens[:start]
                ids = await complete(prompt, end - start)
                counted[0] += len(ids)
                if len(ids) != end - start:
                    mismatches.append(f"{len(ids)} tokens instead of {end - start}")
                if args.raw_prompts == "own" and k + 1 < len(spans):
                    # own sampled ids, then the framework's recorded tool-result tokens
                    prompt = prompt + ids + tokens[end:spans[k + 1][0]]

    gc.collect()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    seconds = time.perf_counter() - started
    if mismatches:
        raise RuntimeError(f"{len(mismatches)} raw turns differ in length from the "
                           f"framework's; first: {mismatches[0]}")
    return RunResult("raw", pair, counted[0], seconds, workload.requests,
                     {"mean_in_flight": busy[0] / seconds, "retries": retries[0]})


async def warm_up(env: EchoBenchEnv, session: aiohttp.ClientSession, url: str,
                  sampling: dict[str, Any], args: argparse.Namespace) -> None:
    """First requests compile/allocate on the server (new batch shapes, too), the first
    rollouts import, compile templates and start threads on the client: a few single
    requests, then a short run of each side at full concurrency. None of it is timed."""
    started = time.perf_counter()
    payload = {"model": SERVED_NAME, "prompt": list(range(1, 60)), "max_tokens": 16,
               **sampling, "logprobs": 0, "return_token_ids": True}
    payload["min_tokens"] = 15

    async def one() -> None:
        async with session.post(url + "/v1/completions", json=payload) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"warm-up request answered {response.status}")

    for concurrency in (1, 8):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    groups = -(-args.concurrency // args.group_size) + 1  # a full wave and then some
    _, workload = await framework_run(env, args, 0, groups)
    await raw_run(session, url, workload, sampling, args, 0)
    print(f"warm-up: {time.perf_counter() - started:.1f} s", flush=True)


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def summarize(results: list[RunResult], args: argparse.Namespace) -> dict[str, Any]:
    print()
    print(f"{'run':>3} | {'side':<9} | {'tokens':>7} | {'requests':>8} | {'seconds':>7} | "
          f"{'tokens/s':>8} | {'in flight':>9} | {'client CPU ms/turn':>18} | "
          f"{'server CPU s':>12} | {'other CPU s':>11}")
    print(f"{'-' * 3}-+-{'-' * 9}-+-{'-' * 7}-+-{'-' * 8}-+-{'-' * 7}-+-{'-' * 8}-+-{'-' * 9}-+-"
          f"{'-' * 18}-+-{'-' * 12}-+-{'-' * 11}")
    for r in results:
        e = r.extra
        print(f"{r.pair:>3} | {r.side:<9} | {r.tokens:>7} | {r.requests:>8} | "
              f"{r.seconds:>7.2f} | {r.tokens_per_s:>8.1f} | {e['mean_in_flight']:>9.1f} | "
              f"{e['client_cpu_s'] / r.requests * 1e3:>18.2f} | {e['server_cpu_s']:>12.2f} | "
              f"{e['other_cpu_s']:>11.2f}")
    print("(in flight: mean completion requests open; client CPU: this process; server "
          "CPU: the vLLM processes; other CPU: the rest of the machine's "
          f"{os.cpu_count()} cores, e.g. other users)")
    print()
    pairs = []
    for pair in sorted({r.pair for r in results}):
        fw = next(r for r in results if r.pair == pair and r.side == "framework")
        raw = next(r for r in results if r.pair == pair and r.side == "raw")
        ratio = fw.tokens_per_s / raw.tokens_per_s
        # Extra wall time of the framework, spread over its turns and concurrent slots:
        # what each turn costs on top of the server's work (an estimate).
        overhead_ms = (fw.seconds - raw.seconds) * args.concurrency / fw.requests * 1e3
        # another user's CPU during either run makes the pair unreliable
        other = max(r.extra["other_cpu_s"] / r.seconds for r in (fw, raw))
        disturbed = other > DISTURBED_CORES
        pairs.append({"pair": pair, "ratio": ratio, "overhead_ms_per_turn": overhead_ms,
                      "disturbed": disturbed})
        print(f"pair {pair}: framework / raw = {ratio:.3f}  "
              f"(~{overhead_ms:+.1f} ms per turn per rollout slot)"
              + (f"  [disturbed: other processes used {other:.2f} cores]" if disturbed else ""))
    clean = [p["pair"] for p in pairs if not p["disturbed"]]

    def overall(pair_ids: list[int]) -> dict[str, Any]:
        totals = {}
        for side in ("framework", "raw"):
            runs = [r for r in results if r.side == side and r.pair in pair_ids]
            tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
            totals[side] = {"tokens": tokens, "seconds": seconds,
                            "tokens_per_s": tokens / seconds}
        ratios = sorted(p["ratio"] for p in pairs if p["pair"] in pair_ids)
        middle = len(ratios) // 2
        median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
        return {"pairs": pair_ids, **totals, "median_pair_ratio": median,
                "ratio": totals["framework"]["tokens_per_s"] / totals["raw"]["tokens_per_s"]}

    def show(label: str, o: dict[str, Any]) -> None:
        print(f"{label}: framework {o['framework']['tokens_per_s']:.1f} tokens/s, "
              f"raw {o['raw']['tokens_per_s']:.1f} tokens/s, framework / raw = "
              f"{o['ratio']:.3f} (median of pairs {o['median_pair_ratio']:.3f})")

    every = overall([p["pair"] for p in pairs])
    show("overall, all pairs", every)
    verdict = every
    if clean and len(clean) < len(pairs):
        undisturbed = overall(clean)
        show(f"overall, undisturbed pairs ({', '.join(map(str, clean))})", undisturbed)
        verdict = undisturbed
    elif not clean:
        print("every pair was disturbed by other processes: the ratio is unreliable")
    met = verdict["ratio"] >= TARGET_RATIO
    print(f"Target (framework >= {TARGET_RATIO:.2f} x raw tokens/s"
          f"{', undisturbed pairs' if verdict is not every else ''}): "
          f"{'MET' if met else 'NOT met'} ({verdict['ratio']:.3f})")
    return {"pairs": pairs, "overall": every,
            "overall_undisturbed": overall(clean) if clean else None,
            "ratio": verdict["ratio"], "target_ratio": TARGET_RATIO, "target_met": met}


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


async def bench(args: argparse.Namespace, server: VLLMProcess) -> tuple[list[RunResult], dict]:
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(server.model_dir).eos_token_id
    sampling = sampling_params(args, eos)
    config = EnvConfig(
        tokenizer=str(server.model_dir), inference_servers=[server.url], model=SERVED_NAME,
        group_size=args.group_size, max_turns=args.turns, concurrency=args.concurrency,
        max_token_length=args.max_model_len, max_tokens_per_turn=args.tokens_per_turn,
        temperature=args.temperature, top_p=1.0,
        sampling_extra={k: v for k, v in sampling.items()
                        if k not in ("temperature", "top_p")},
        keep_equal_score_groups=True, tool_parser=PARSER_NAME,
        request_timeout_s=args.request_timeout)
    env = EchoBenchEnv(config, tool_kind=args.tool)
    await env.start()
    timed_requests(env._pool)
    clock = CPUClock(server.proc.pid)
    connector = aiohttp.TCPConnector(limit=0)  # as VLLMServerPool's session
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    results: list[RunResult] = []
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await warm_up(env, session, server.url, sampling, args)
            workload = None
            # framework, raw, raw, framework, framework, raw, ...: pair i is the i-th run
            # of each side; raw replays the latest framework run's trajectories.
            order = []
            for pair in range(1, args.repeats + 1):
                sides = ("framework", "raw") if pair % 2 else ("raw", "framework")
                order += [(pair, side) for side in sides]
            for pair, side in order:
                await reset_prefix_cache(session, server.url)
                before = clock.read()
                if side == "framework":
                    result, workload = await framework_run(env, args, pair)
                    e = result.extra
                    tail = e["all_completed_request_tokens"] - result.tokens
                    print(f"[{pair}] framework: {result.tokens} tokens in "
                          f"{result.seconds:.2f} s = {result.tokens_per_s:.1f} tokens/s "
                          f"({e['groups']} groups, {e['trajectories']} episodes, "
                          f"{e['tool_calls_run']} tool calls run; {tail} more tokens sampled for "
                          f"groups past --groups"
                          + (f"; {e['retries']} requests retried" if e["retries"] else "")
                          + ")", flush=True)
                else:
                    if workload is None:  # raw first in this pair: replay the last framework run
                        raise RuntimeError("no framework run to replay yet")
                    result = await raw_run(session, server.url, workload, sampling, args, pair)
                    if result.tokens != workload.tokens:
                        raise RuntimeError(f"raw sampled {result.tokens} tokens, the framework "
                                           f"{workload.tokens}")
                    retried = result.extra["retries"]
                    print(f"[{pair}] raw:       {result.tokens} tokens in "
                          f"{result.seconds:.2f} s = {result.tokens_per_s:.1f} tokens/s"
                          + (f" ({retried} requests retried)" if retried else ""),
                          flush=True)
                result.extra.update(clock.since(before))
                results.append(result)
    finally:
        await env.close()
    return results, {"sampling": sampling}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Tokens/s of env rollouts through the framework vs. raw /v1/completions "
                    "calls, same server, same requests, one run.")
    parser.add_argument("--groups", type=int, default=16, help="groups per framework run")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per group")
    parser.add_argument("--turns", type=int, default=3, help="assistant turns per episode")
    parser.add_argument("--tokens-per-turn", type=int, default=64,
                        help="tokens sampled per assistant turn (the last is end-of-turn)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="rollouts (framework) / trajectories (raw) in flight")
    parser.add_argument("--repeats", type=int, default=3,
                        help="(framework, raw) pairs, run in the order F R R F F R ...")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tool", choices=["inline", "sync", "async"], default="inline",
                        help="echo as a sync function run on the event loop (@tool(inline="
                             "True), what a cheap pure tool should use), as a sync function "
                             "run in a worker thread (the default for tools), or as a "
                             "coroutine")
    parser.add_argument("--raw-prompts", choices=["own", "recorded"], default="own",
                        help="raw prompts: own sampled ids + recorded tool results (same "
                             "prefill work as the framework), or the framework's tokens")
    parser.add_argument("--client-nice", type=int, default=-10,
                        help="nice value of the benchmark client, both sides (0: leave the "
                             "scheduler alone). The CPU vLLM server busy-polls every core; "
                             "without this the client waits for a core for seconds")
    parser.add_argument("--model-dir", type=Path,
                        help="a model directory to serve (default: build the tiny model "
                             "in a temporary directory)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--server-log", type=Path,
                        help="vLLM server log (default: in the temporary directory)")
    parser.add_argument("--json", metavar="OUT", help="also write the numbers as JSON to OUT")
    args = parser.parse_args(argv)
    for name in ("groups", "group_size", "turns", "tokens_per_turn", "concurrency", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


_CHILD_MARKER = "_LACHESIS_ROLLOUT_OVERHEAD_CHILD"


def _run_in_own_session(argv: list[str], script: str | Path = __file__) -> int:
    """Re-run ``script`` (default: this one) in a new session (so a new scheduler
    autogroup, whose nice value can be changed without touching the caller's), forwarding
    Ctrl-C/SIGTERM."""
    child = subprocess.Popen([sys.executable, str(Path(script).resolve()), *argv],
                             env={**os.environ, _CHILD_MARKER: "1"}, start_new_session=True)

    def forward(signum: int, frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return child.wait()


def _die_with_parent() -> None:
    """SIGTERM this process when the parent that re-ran it dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def raise_client_priority(nice: int) -> str:
    """Give this process's threads (and its session's autogroup) the nice value ``nice``;
    the vLLM server, started before and in its own session, keeps its own."""
    done = []
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
        done.append(f"autogroup nice {nice}")
    except OSError as error:
        done.append(f"autogroup unchanged ({error.strerror})")
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        done.append(f"thread nice {nice}")
    except (OSError, ValueError) as error:
        done.append(f"thread nice unchanged ({getattr(error, 'strerror', error)})")
    return ", ".join(done)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.client_nice and not os.environ.get(_CHILD_MARKER):
        return _run_in_own_session(argv)
    if os.environ.get(_CHILD_MARKER):
        _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # stop the server on kill too
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from lachesis.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / SERVED_NAME, seed=0)
        server = VLLMProcess(model_dir, served_model_name=SERVED_NAME,
                             max_model_len=args.max_model_len, dev_mode=True,
                             extra_args=["--enable-auto-tool-choice",
                                         "--tool-call-parser", "hermes"],
                             log_path=args.server_log or Path(tmp) / "vllm.log")
        print(f"Workload: {args.groups} groups x {args.group_size} episodes x {args.turns} "
              f"turns x {args.tokens_per_turn} tokens = "
              f"{args.groups * args.group_size * args.turns * args.tokens_per_turn} tokens per "
              f"run, concurrency {args.concurrency}, {args.repeats} pairs, raw prompts: "
              f"{args.raw_prompts}", flush=True)
        print(f"starting vLLM: {' '.join(server.command())}", flush=True)
        started = time.perf_counter()
        try:
            server.start()
            server.wait_ready(timeout=args.startup_timeout)
            print(f"vLLM ready in {time.perf_counter() - started:.0f} s at {server.url}",
                  flush=True)
            if args.client_nice:
                print(f"benchmark client (both sides): {raise_client_priority(args.client_nice)}",
                      flush=True)
            results, info = asyncio.run(bench(args, server))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except Exception as error:
            print(f"FAILED: {type(error).__name__}: {error}", file=sys.stderr)
            tail = server.log_tail(2000)
            if tail:
                print(f"--- vLLM log (tail) ---\n{tail}", file=sys.stderr)
            return 1
        finally:
            server.stop()

    report = summarize(results, args)
    if args.json:
        out = {
            "workload": {k: (str(v) if isinstance(v, Path) else v)
                         for k, v in vars(args).items() if k != "json"},
            **info,
            "runs": [{"side": r.side, "pair": r.pair, "tokens": r.tokens,
                      "requests": r.requests, "seconds": round(r.seconds, 4),
                      "tokens_per_s": round(r.tokens_per_s, 2), **r.extra} for r in results],
            **report,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
