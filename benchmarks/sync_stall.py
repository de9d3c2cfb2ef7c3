"""Weight syncs during long-tail agentic rollouts: ``sync_pause: keep`` vs ``wait``, side
by side in one run on one vLLM CPU server (and ``keep-stale``: ``keep`` with
``sync_stale_kv``, the frozen requests going on over the old weights' keys/values).

Workload (the same for every mode: one seed): ``--episodes`` multi-turn episodes run at
once, each replaced by a new one when it ends, for ``--seconds`` per mode. An episode is
``--turns`` assistant turns on the tiny model (2 layers, hidden 128, random weights, byte
tokenizer) through the project's own client (``VLLMServerPool``, token in / token out,
``ignore_eos``), with 16 "tool result" tokens between turns. A turn's length is drawn
from a long tail: with probability ``--long-p`` (0.1) it runs to near the context limit
(``--long-tokens``: 3,000 to 3,900 tokens, capped by the room left of 4,096), else 24 to
160 tokens.

The trainer stand-in: it "trains" for ``--step-s`` seconds (a sleep: the trainer's own
compute is elsewhere, e.g. a GPU), then syncs new weights into the server with the
trainer's own code (``VLLMWeightSync.reload``: pause, ``reload_weights`` from a
checkpoint on disk, label, resume), alternating between two checkpoints, and so on.

Reported per mode: the sync time the trainer sees (median, max, count), the rollout
tokens per second (tokens of the turns that finished inside the window, over the
window), turns finished, and, from vLLM's own ``/metrics`` sampled every 0.1 s, the
share of samples with no request running (``vllm_idle_fraction``) and the mean number
of running requests, overall and while a sync is under way. Targets (issue 41): keep's
median sync >= 5x faster than wait's, and its rollout tokens per second >= 1.3x.

    python benchmarks/sync_stall.py [--seconds 60] [--episodes 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402

MAX_MODEL_LEN = 4096
TOOL_TOKENS = 16
PROMPT_TOKENS = 32


def turn_lengths(rng: random.Random, turns: int, long_p: float,
                 long_tokens: tuple[int, int]) -> list[int]:
    return [rng.randint(*long_tokens) if rng.random() < long_p else rng.randint(24, 160)
            for _ in range(turns)]


async def one_mode(mode: str, url: str, checkpoints: list[Path], args) -> dict:
    from environments.inference.vllm_client import VLLMServerPool
    from trainer.vllm_busy import running_requests
    from trainer.vllm_sync import VLLMWeightSync

    rng = random.Random(args.seed)  # the same episodes for every mode
    long_tokens = tuple(int(x) for x in args.long_tokens.split(","))
    plans = [turn_lengths(rng, args.turns, args.long_p, long_tokens) for _ in range(10_000)]
    sync = VLLMWeightSync([url], checkpoints[0].parent, pause=mode.split("-")[0],
                          stale_kv=mode == "keep-stale")
    pool = VLLMServerPool([url], "tiny")
    await pool.start()
    stop = asyncio.Event()
    finished: list[tuple[float, int]] = []  # (when, tokens) per turn
    syncing = False
    samples: list[tuple[bool, float]] = []  # (during a sync, running requests)
    next_plan = iter(range(len(plans)))

    async def episodes() -> None:
        while not stop.is_set():
            plan = plans[next(next_plan)]
            context = [rng_tokens.randrange(3, 250) for _ in range(PROMPT_TOKENS)]
            for length in plan:
                if stop.is_set():
                    return
                room = MAX_MODEL_LEN - len(context) - 1
                completion = await pool.complete(
                    context, max_tokens=min(length, room),
                    sampling={"temperature": 1.0, "ignore_eos": True})
                finished.append((time.monotonic(), len(completion.token_ids)))
                context += completion.token_ids
                context += [rng_tokens.randrange(3, 250) for _ in range(TOOL_TOKENS)]
                if len(context) + 8 >= MAX_MODEL_LEN:
                    break

    async def trainer() -> list[float]:
        nonlocal syncing
        seconds, n = [], 0
        while not stop.is_set():
            await asyncio.sleep(args.step_s)
            if stop.is_set():
                break
            n += 1
            syncing = True
            started = time.monotonic()
            await sync.reload(checkpoints[n % 2])
            seconds.append(time.monotonic() - started)
            syncing = False
        return seconds

    async def sampler() -> None:
        while not stop.is_set():
            value = await asyncio.to_thread(running_requests, url)
            if value is not None:
                samples.append((syncing, value))
            await asyncio.sleep(0.1)

    rng_tokens = random.Random(args.seed + 1)
    workers = [asyncio.create_task(episodes()) for _ in range(args.episodes)]
    await asyncio.sleep(args.warmup_s)  # every episode is generating
    window_start = time.monotonic()
    watch = asyncio.create_task(sampler())
    training = asyncio.create_task(trainer())
    await asyncio.sleep(args.seconds)
    stop.set()
    window_end = time.monotonic()
    syncs = await training
    await watch
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    # the episodes' requests that were cut off are aborted, so the next mode starts clean
    async with aiohttp.ClientSession() as session:
        await session.post(url + "/abort_requests", json={})
    await pool.close()
    tokens = sum(n for when, n in finished if window_start <= when <= window_end)
    turns = sum(1 for when, _ in finished if window_start <= when <= window_end)
    during = [v for s, v in samples if s]
    return {
        "syncs": len(syncs),
        "sync_s_median": statistics.median(syncs) if syncs else None,
        "sync_s_max": max(syncs) if syncs else None,
        "sync_s_all": [round(s, 4) for s in syncs],
        "rollout_tokens_per_s": tokens / (window_end - window_start),
        "turns_finished": turns,
        "vllm_idle_fraction": sum(v == 0 for _, v in samples) / max(1, len(samples)),
        "vllm_mean_running": statistics.fmean(v for _, v in samples) if samples else None,
        "vllm_mean_running_during_syncs": statistics.fmean(during) if during else None,
        "vllm_idle_fraction_during_syncs": (sum(v == 0 for v in during) / len(during))
        if during else None,
    }


async def warm_up(url: str) -> None:
    from environments.inference.vllm_client import VLLMServerPool

    async with VLLMServerPool([url], "tiny") as pool:
        await asyncio.gather(*(pool.complete(list(range(3, 3 + PROMPT_TOKENS)), max_tokens=64,
                                             sampling={"ignore_eos": True})
                               for _ in range(4)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="keep,keep-stale,wait",
                        help="keep, keep-stale (keep with sync_stale_kv), wait, abort")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window per mode")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--long-p", type=float, default=0.1)
    parser.add_argument("--long-tokens", default="3000,3900",
                        help="a long turn's length range (capped by the room left in the "
                             "context, 4,096 tokens)")
    parser.add_argument("--step-s", type=float, default=2.0,
                        help="the trainer stand-in's step between syncs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from environments.inference.vllm_process import VLLMProcess
    from lachesis.tiny_model import make_tiny_model
    from trainer.vllm_sync import VLLMWeightSync

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    with tempfile.TemporaryDirectory(prefix="sync-stall-") as tmp:
        tmp = Path(tmp)
        model_dir = make_tiny_model(tmp / "tiny", seed=0, tied=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        writer = VLLMWeightSync([], tmp / "weights", keep=10)
        checkpoints = [writer.save(model, None, 1)]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 1e-3)
        checkpoints.append(writer.save(model, None, 2))
        server = VLLMProcess(model_dir, served_model_name="tiny", max_model_len=MAX_MODEL_LEN,
                             dev_mode=True, log_path=tmp / "vllm.log")
        results = {}
        with server:
            asyncio.run(warm_up(server.url))  # vLLM's first request is slow: not measured
            for mode in modes:
                print(f"{mode}: {args.seconds:.0f} s of rollouts with a sync every "
                      f"{args.step_s} s ...", flush=True)
                results[mode] = asyncio.run(one_mode(mode, server.url, checkpoints, args))
                r = results[mode]
                print(f"  {r['syncs']} syncs, median {r['sync_s_median']:.3f} s, max "
                      f"{r['sync_s_max']:.3f} s; {r['rollout_tokens_per_s']:.0f} rollout "
                      f"tokens/s; vLLM idle {r['vllm_idle_fraction']:.1%}, mean running "
                      f"{r['vllm_mean_running']:.2f}", flush=True)
    out = {**results, "workload": {k: v for k, v in vars(args).items() if k != "json"}}
    if "keep" in results and "wait" in results:
        keep, wait = results["keep"], results["wait"]
        out["ratios"] = {
            "sync_median_wait_over_keep": wait["sync_s_median"] / keep["sync_s_median"],
            "rollout_tokens_per_s_keep_over_wait":
                keep["rollout_tokens_per_s"] / wait["rollout_tokens_per_s"]}
        if "keep-stale" in results:
            out["ratios"]["rollout_tokens_per_s_keep_stale_over_wait"] = \
                results["keep-stale"]["rollout_tokens_per_s"] / wait["rollout_tokens_per_s"]
        ratios = out["ratios"]
        print(f"keep vs wait: median sync {ratios['sync_median_wait_over_keep']:.1f}x faster "
              f"(target >= 5x), rollout tokens/s {ratios['rollout_tokens_per_s_keep_over_wait']:.2f}x "
              f"(target >= 1.3x)")
        if "keep-stale" in results:
            print(f"keep-stale vs wait: rollout tokens/s "
                  f"{ratios['rollout_tokens_per_s_keep_stale_over_wait']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
