"""A packaged model's speed and alignment per dtype, side by side in one run (issue 75):
SmolLM2-135M-Instruct by default, float32 and bfloat16.

For each dtype (``--dtypes``; bfloat16 only where the CPU computes it natively, AMX-BF16 or
AVX512-BF16 in /proc/cpuinfo: it is skipped elsewhere, and the script says so), one after
the other, nothing else of this script running meanwhile:

1. **Training tokens/s.** ``transformers``, the model's full weights in that dtype, AdamW,
   ``--rows`` rows of ``--row-tokens`` random tokens a step (batch 8 x 256 by default), the
   causal-LM loss on every token, no gradient checkpointing, no chunked logits; one
   warm-up step, then ``--train-steps`` timed steps: tokens/s = rows x tokens / the median
   step.
2. **vLLM CPU generation tokens/s.** One vLLM server (the config's vLLM settings:
   ``max_model_len``, KV cache; eager) in that dtype; after a warm-up request,
   ``--concurrency`` batches (8, 32, 64) of that many concurrent requests, each a
   128-token completion (``--gen-tokens``, ``ignore_eos``, temperature 1) of the same short
   chat prompt: tokens/s = the tokens sampled / the batch's wall time.
3. **Alignment on multi-turn tool episodes.** ``lachesis env process`` of the config's env
   (``--config``: configs/smollm2.yaml's ``arithmetic_tool``, word problems with a
   calculator; ``--groups`` groups) against that server, with ``--model``, the warm-started
   policy (so it calls the tool: episodes of two or three turns); the server stopped, then
   ``lachesis train --check --data GROUPS --dtype D``: the trainer's logprobs of the
   sampled tokens against vLLM's recorded ones, mean absolute difference (the tolerance
   raised so that a large figure is printed, not refused).

It prints a table per dtype and the ratios bfloat16 / float32; ``--json OUT`` writes it
all. Heavy (two vLLM servers one after the other, full-weight training): run it alone.

    flock /tmp/lachesis-heavy.lock .venv/bin/python benchmarks/packaged_model_speed.py \\
        --model runs/smollm2/warm_start/final --json /tmp/packaged_model_speed.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

ALIGNMENT_GOAL_FLOAT32 = 1e-4
PROMPT = [{"role": "user", "content": "Tell me a story about a robot who learns to paint."}]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def training_speed(model_dir: str, dtype: str, rows: int, row_tokens: int, steps: int,
                   warmup: int, seed: int = 0) -> dict[str, Any]:
    """Full-weight AdamW steps on random rows (every token a label); tokens/s of the
    median timed step."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = model.config.vocab_size
    seconds = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (rows, row_tokens))
        started = time.monotonic()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            seconds.append(time.monotonic() - started)
    del model, optimizer
    median = statistics.median(seconds)
    return {"rows": rows, "row_tokens": row_tokens, "timed_steps": steps,
            "step_s": [round(s, 3) for s in seconds], "median_step_s": round(median, 3),
            "tokens_per_s": rows * row_tokens / median}


async def _complete(session: Any, url: str, model: str, prompt: list[int],
                    tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
            "ignore_eos": True, "temperature": 1.0}
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        out = await response.json()
    return int(out["usage"]["completion_tokens"])


async def generation_speed(url: str, model: str, prompt: list[int], levels: list[int],
                           tokens: int) -> list[dict[str, Any]]:
    """Per concurrency level: that many concurrent ``tokens``-token completions."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await _complete(session, url, model, prompt, 16)  # the first request is slow
        out = []
        for n in levels:
            started = time.monotonic()
            sampled = await asyncio.gather(*(_complete(session, url, model, prompt, tokens)
                                             for _ in range(n)))
            seconds = time.monotonic() - started
            out.append({"concurrency": n, "tokens": sum(sampled), "seconds": round(seconds, 2),
                        "tokens_per_s": sum(sampled) / seconds})
            print(f"    {n} concurrent: {sum(sampled)} tokens in {seconds:.1f} s = "
                  f"{sum(sampled) / seconds:.0f} tokens/s", flush=True)
    return out


def episodes(groups_path: Path) -> dict[str, Any]:
    """Turns and tool calls of the episodes in ``groups_path``."""
    trajectories = turns = 0
    calls = 0
    for line in groups_path.read_text().splitlines():
        for t in json.loads(line)["trajectories"]:
            trajectories += 1
            turns += len(t.get("turn_spans") or [])
            calls += sum(1 for m in t.get("messages") or [] if m.get("role") == "tool")
    return {"episodes": trajectories, "mean_turns": turns / trajectories if trajectories else 0,
            "tool_results_per_episode": calls / trajectories if trajectories else 0}


def run(cmd: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        f.write(done.stdout)
    return done


def measure_dtype(args: argparse.Namespace, dtype: str, env_settings: dict[str, Any],
                  vllm_settings: dict[str, Any], workdir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from environments.inference.vllm_process import VLLMProcess

    result: dict[str, Any] = {"dtype": dtype}
    print(f"-- {dtype}: training ({args.rows} x {args.row_tokens} tokens a step)", flush=True)
    result["training"] = training_speed(args.model, dtype, args.rows, args.row_tokens,
                                        args.train_steps, args.train_warmup)
    print(f"    {result['training']['tokens_per_s']:.0f} tokens/s (median step "
          f"{result['training']['median_step_s']:.2f} s)", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt = list(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    groups_path = workdir / f"groups-{dtype}.jsonl"
    log = workdir / f"{dtype}.log"
    started = time.monotonic()
    with VLLMProcess(args.model, dtype=dtype,
                     max_model_len=vllm_settings.get("max_model_len", 1024),
                     kv_cache_space_gib=vllm_settings.get("kv_cache_gib", 1),
                     log_path=workdir / f"vllm-{dtype}.log") as server:
        result["vllm_start_s"] = round(time.monotonic() - started, 1)
        print(f"-- {dtype}: vLLM generation ({args.gen_tokens}-token completions, up in "
              f"{result['vllm_start_s']} s)", flush=True)
        result["generation"] = asyncio.run(generation_speed(
            server.url, server.model_name, prompt, args.concurrency, args.gen_tokens))
        print(f"-- {dtype}: {args.groups} groups of the env against it", flush=True)
        env_yaml = workdir / f"env-{dtype}.yaml"
        env_yaml.write_text(yaml.safe_dump({
            **env_settings, "tokenizer": args.model, "inference_servers": [server.url],
            "keep_equal_score_groups": True, "seed": args.seed}))
        done = run([sys.executable, "-m", "lachesis.cli", "env", "process",
                    args.env, "--config", str(env_yaml), "--out", str(groups_path),
                    "--groups", str(args.groups)], log, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"lachesis env process failed ({done.returncode}; log: {log})")
    result["episodes"] = episodes(groups_path)
    print(f"    {result['episodes']}", flush=True)
    print(f"-- {dtype}: lachesis train --check --dtype {dtype}", flush=True)
    n = result["episodes"]["episodes"]
    done = run([sys.executable, "-m", "lachesis.cli", "train", "--check",
                "--data", str(groups_path), "--model", args.model, "--dtype", dtype,
                "--batch-size", str(n), "--alignment-tolerance", "100",
                "--max-token-length", str(env_settings.get("max_token_length", 2048)),
                "--run-dir", str(workdir / f"check-{dtype}"), "--tensorboard", "false"],
               log, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"lachesis train --check failed ({done.returncode}; log: {log})")
    summary = json.loads(done.stdout.decode()[done.stdout.decode().index("{"):])
    result["alignment_mean_abs_diff"] = summary.get("alignment_mean_abs_diff")
    result["alignment_compared_tokens"] = summary.get("alignment_compared_tokens")
    print(f"    mean |trainer - vLLM| logprob = {result['alignment_mean_abs_diff']:.2e} over "
          f"{result['alignment_compared_tokens']} tokens", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="runs/smollm2/warm_start/final",
                        help="the policy: a HF checkpoint dir (the smollm2 config's warm "
                        "start, so that its episodes call the tool) or a packaged model's "
                        "name (`lachesis model list`)")
    parser.add_argument("--config", default="configs/smollm2.yaml",
                        help="the run config whose first env and vLLM settings are used")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, default=256)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--train-warmup", type=int, default=1)
    parser.add_argument("--concurrency", default="8,32,64")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--groups", type=int, default=4,
                        help="env groups sampled for the alignment check")
    parser.add_argument("--seed", type=int, default=1, help="the env's seed")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from environments.inference.dtypes import cpu_bf16_flags
    from environments.inference.packaged_models import resolve_model

    args.model = resolve_model(args.model) if not Path(args.model).exists() \
        else str(Path(args.model).resolve())
    if not Path(args.model, "config.json").exists():
        sys.exit(f"--model {args.model}: no HF model there")
    config_path = Path(args.config) if Path(args.config).exists() else REPO_ROOT / args.config
    config = yaml.safe_load(config_path.read_text())
    env = config["envs"][0]
    args.env = env["name"]
    env_settings = {k: v for k, v in env.get("settings", {}).items()
                    if not k.startswith("eval") and k != "max_queued_groups"}
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    flags = cpu_bf16_flags()
    dtypes = []
    skipped = {}
    for dtype in args.dtypes.split(","):
        if dtype == "bfloat16" and not flags:
            skipped[dtype] = ("this CPU has neither AMX-BF16 nor AVX512-BF16: bfloat16 "
                              "would be emulated (slower than float32)")
            print(f"-- bfloat16 skipped: {skipped[dtype]}", flush=True)
            continue
        dtypes.append(dtype)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="packaged-model-speed-"))
    workdir.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "bf16_flags": flags}
    print(f"{args.model} on {machine['cpu']} ({machine['cores']} cores, native bf16: "
          f"{', '.join(flags) or 'none'}); work in {workdir}", flush=True)
    results = [measure_dtype(args, d, env_settings, config.get("vllm", {}), workdir)
               for d in dtypes]

    print(f"\n{Path(args.model).name} ({args.model}), {machine['cpu']}, "
          f"{machine['cores']} cores\n")
    levels = args.concurrency
    print("| dtype | training tokens/s | " + " | ".join(
        f"vLLM tokens/s at {n}" for n in levels) + " | alignment (mean abs diff) | tokens |")
    print("|---|---:|" + "---:|" * len(levels) + "---:|---:|")
    for r in results:
        gen = {g["concurrency"]: g["tokens_per_s"] for g in r["generation"]}
        print(f"| {r['dtype']} | {r['training']['tokens_per_s']:.0f} | " + " | ".join(
            f"{gen[n]:.0f}" for n in levels) + f" | {r['alignment_mean_abs_diff']:.2e} | "
            f"{r['alignment_compared_tokens']} |")
    by = {r["dtype"]: r for r in results}
    ratios = None
    if "float32" in by and "bfloat16" in by:
        f32, b16 = by["float32"], by["bfloat16"]
        gen32 = {g["concurrency"]: g["tokens_per_s"] for g in f32["generation"]}
        gen16 = {g["concurrency"]: g["tokens_per_s"] for g in b16["generation"]}
        ratios = {"training": b16["training"]["tokens_per_s"] / f32["training"]["tokens_per_s"],
                  **{f"generation_{n}": gen16[n] / gen32[n] for n in levels},
                  "alignment": b16["alignment_mean_abs_diff"] / f32["alignment_mean_abs_diff"]
                  if f32["alignment_mean_abs_diff"] else None}
        print("| bfloat16 / float32 | " + f"{ratios['training']:.2f} | " + " | ".join(
            f"{ratios[f'generation_{n}']:.2f}" for n in levels) + " | " +
            (f"{ratios['alignment']:.0f}x" if ratios["alignment"] else "-") + " | |")
    if "float32" in by:
        diff = by["float32"]["alignment_mean_abs_diff"]
        print(f"\nfloat32 alignment {diff:.2e} (goal <= {ALIGNMENT_GOAL_FLOAT32:g}: "
              f"{'met' if diff <= ALIGNMENT_GOAL_FLOAT32 else 'NOT met'})")
    for dtype, why in skipped.items():
        print(f"{dtype}: skipped ({why})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "machine": machine, "results": results, "ratios": ratios,
            "skipped": skipped, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
            indent=1))


if __name__ == "__main__":
    main()
