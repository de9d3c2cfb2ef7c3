"""Trainer memory and speed with and without packing, chunked logprobs and activation
checkpointing: one training micro-step per configuration, each in a fresh process.

Model: a ``Qwen2ForCausalLM`` built from a config (random weights, nothing downloaded)
with Qwen2's vocabulary of 151,936 tokens and a small body (``--hidden`` 256, ``--layers``
4, heads of 64, 2 KV heads, tied embeddings, as Qwen2.5-0.5B), float32 on the CPU and
bfloat16 on CUDA. At this vocabulary the output projection and its log-softmax are what
an RL step's memory is made of.

Batch: one micro-batch of ``--lengths`` rows (default 7 x 568 and 120: 4,096 real
tokens, lengths spread 4.7x, 4,544 tokens when right-padded: the padded full-logits step
holds about four float32 ``[padded tokens, vocab]`` tensors at its peak, ~11 GiB here,
and this machine's 24 GiB are shared; 1024 x 3, 512, 256 x 2 padded to 6,144 peaked at
15 GiB and 640 x 2, 576 x 2, 512 x 2, 480, 160 padded to 5,120 at 12.5 GiB, which other
processes' memory left no room for twice), random tokens, the
first quarter of each row a masked prompt and the rest trained, random advantages and
behaviour logprobs. A step is ``trainer.train.train_step`` as ``lachesis train`` runs it
(RL clipped surrogate with TIS, token mean, grad-norm clip, AdamW whose state exists
before the step), with the whole batch in one micro-batch, under each configuration:

  * ``padded_full``: the path before packing: right-padded rows, full float32 logits.
  * ``packed``: rows packed into one sequence (position ids restart per row), full
    float32 logits of the positions that predict a trained token.
  * ``chunked``: right-padded rows, ``trainer.losses.chunked_token_logprobs`` in chunks of
    ``--chunk`` tokens over the trained positions.
  * ``packed_chunked_ckpt``: packing + chunked logprobs + activation checkpointing (the
    defaults of ``lachesis train`` plus ``activation_checkpointing: true``).

Reported per configuration: ``peak_mib``, the peak memory the step adds (CPU: the
process's peak resident set, reset through ``/proc/self/clear_refs`` just before the
step, minus its resident set then; CUDA: ``torch.cuda.max_memory_allocated`` minus the
memory allocated before the step), and ``tokens_per_s``, real (non-padding) tokens over
the median of ``--repeats`` step times. The targets (CPU): ``packed_chunked_ckpt`` peak
<= 0.35 x ``padded_full``, ``packed`` tokens/s >= 1.3 x ``padded_full``.

    .venv/bin/python benchmarks/trainer_memory.py --device cpu --json runs/trainer_memory.json
    python benchmarks/trainer_memory.py --device cuda --json trainer_memory_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

CONFIGS = {
    "padded_full": {"packing": False, "logprob_chunk_size": None,
                    "activation_checkpointing": False},
    "packed": {"packing": True, "logprob_chunk_size": None, "activation_checkpointing": False},
    "chunked": {"packing": False, "activation_checkpointing": False},
    "packed_chunked_ckpt": {"packing": True, "activation_checkpointing": True},
}
TARGET_PEAK_RATIO = 0.35
TARGET_SPEEDUP = 1.3


def memory_available() -> int | None:
    from trainer.memory import proc_kib_field

    return proc_kib_field("/proc/meminfo", "MemAvailable")


def build(args, device, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.batch import Sample, pack
    from trainer.logprobs import attention_implementation

    heads = max(1, args.hidden // 64)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=min(2, heads),
                         max_position_embeddings=32768, tie_word_embeddings=True,
                         use_sliding_window=False)
    packing = CONFIGS[args.child]["packing"]
    config._attn_implementation = attention_implementation(device, dtype, packing) or "sdpa"
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    rng = random.Random(args.seed)
    rows, advantages = [], []
    for n in args.lengths:
        tokens = [rng.randrange(args.vocab) for _ in range(n)]
        prompt = max(1, n // 4)
        masks = [-100] * prompt + tokens[prompt:]
        logprobs = [1.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(n - prompt)]
        rows.append(Sample(tokens, masks, logprobs))
        advantages.append([rng.uniform(-1, 1)] * n)
    return model, pack(rows, advantages).to(device)


def child(args) -> dict:
    """One configuration, in this (fresh) process."""
    import torch

    from trainer.config import TrainConfig
    from trainer.logprobs import enable_activation_checkpointing
    from trainer.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    from trainer.train import train_step

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model, batch = build(args, device, dtype)
    settings = {"logprob_chunk_size": args.chunk, **CONFIGS[args.child]}
    config = TrainConfig(model="bench", mode="rl", api_url=None, tensorboard=False,
                         micro_batch_size=len(args.lengths),
                         max_tokens_per_micro_batch=sum(args.lengths), **settings)
    if config.activation_checkpointing:
        enable_activation_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    for p in model.parameters():  # AdamW's state exists before the measured step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    times = []
    for repeat in range(args.repeats):
        if repeat == 0:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            else:
                reset = reset_peak_rss()
                base = rss_bytes()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = train_step(model, optimizer, batch, config)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        if repeat == 0:
            peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
                    else peak_rss_bytes()) - base
    real = sum(args.lengths)
    return {"name": args.child, "peak_mib": peak / 2**20,
            "tokens_per_s": real / statistics.median(times), "step_seconds": times,
            "loss": metrics["loss"], "peak_rss_reset": device.type == "cuda" or reset}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[568] * 7 + [120])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=1024, help="logprob_chunk_size")
    parser.add_argument("--repeats", type=int, default=2,
                        help="steps per configuration (peak from the first, speed the median)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated subset of " + ", ".join(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    names = args.configs.split(",")
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    padded = len(args.lengths) * max(args.lengths)
    print(f"Qwen2 shape: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers; "
          f"{len(args.lengths)} rows, {sum(args.lengths)} real tokens ({padded} padded), "
          f"lengths {min(args.lengths)}-{max(args.lengths)}; {args.device}", flush=True)
    # the padded full-logits step holds ~4 float32 [padded tokens, vocab] tensors at once
    need = 4 * padded * args.vocab * 4
    available = memory_available()
    if args.device == "cpu" and "padded_full" in names and available is not None \
            and need > 0.9 * available:
        raise SystemExit(f"padded_full needs ~{need / 2**30:.1f} GiB (4 x {padded} padded tokens "
                         f"x vocab {args.vocab} x 4 B) and {available / 2**30:.1f} GiB is "
                         "available: shorten --lengths or wait for memory")
    results = []
    for name in names:
        command = [sys.executable, __file__, "--child", name, *(argv or sys.argv[1:])]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT,
                              check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{name}: the child process failed (exit {done.returncode})")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"  {name:<20} peak {result['peak_mib']:>9.1f} MiB   "
              f"{result['tokens_per_s']:>8.1f} tokens/s   loss {result['loss']:.6f}", flush=True)

    by_name = {r["name"]: r for r in results}
    checks = {}
    if "padded_full" in by_name:
        base = by_name["padded_full"]
        if "packed_chunked_ckpt" in by_name:
            ratio = by_name["packed_chunked_ckpt"]["peak_mib"] / base["peak_mib"]
            checks["peak_packed_chunked_ckpt_over_padded_full"] = {
                "value": ratio, "target": f"<= {TARGET_PEAK_RATIO}",
                "met": ratio <= TARGET_PEAK_RATIO}
        if "packed" in by_name:
            speedup = by_name["packed"]["tokens_per_s"] / base["tokens_per_s"]
            checks["tokens_per_s_packed_over_padded_full"] = {
                "value": speedup, "target": f">= {TARGET_SPEEDUP}",
                "met": speedup >= TARGET_SPEEDUP}
        for name, r in by_name.items():
            r["peak_vs_padded_full"] = r["peak_mib"] / base["peak_mib"]
            r["speed_vs_padded_full"] = r["tokens_per_s"] / base["tokens_per_s"]
    for key, check in checks.items():
        print(f"{key}: {check['value']:.3f} (target {check['target']}: "
              f"{'met' if check['met'] else 'NOT met'})")
    report = {
        "device": args.device,
        "configs": results,
        "checks": checks,
        "workload": {"lengths": args.lengths, "real_tokens": sum(args.lengths),
                     "padded_tokens": padded, "vocab": args.vocab, "hidden": args.hidden,
                     "layers": args.layers, "chunk": args.chunk, "repeats": args.repeats},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
