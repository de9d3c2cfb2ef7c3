"""Trainer throughput: the real ``train_step`` vs. a bare cross-entropy loop, one run.

Two models, picked by ``--model`` (the default follows the device):

  * ``tiny`` (default on the CPU): the test model of ``lachesis.tiny_model``
    (``make_tiny_model`` into a temporary directory, then ``from_pretrained`` as
    ``lachesis train`` loads it): a random Qwen2 with hidden 128, 2 layers, 2 heads,
    1 KV head, vocabulary 263, untied embeddings; float32 by default.
  * ``qwen2.5-0.5b`` (default when CUDA is available, or with ``--device cuda``): a
    ``Qwen2ForCausalLM`` built from a config with Qwen2.5-0.5B's shape (hidden 896,
    24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied
    embeddings), random weights, nothing downloaded; bfloat16 by default.

Workload (every number is a flag): ``--batch-size`` 16 sequences of ``--seq-len`` 1024
random tokens, all full length (no padding), in ``--batch-size / --group-size`` groups.
Each sequence is a multi-turn rollout: a ``--prompt-len`` 256 token prompt (masked),
then ``--turns`` 3 assistant turns (trained) separated by ``--tool-len`` 64 token tool
results (masked), so 640 of the 1024 tokens are trained. Every turn gets a random score
in [0, 1) (the last one is the outcome). The batch goes through the trainer's own
``batch_tensors`` (checks, MT-GRPO advantages with ``estimator: mt_grpo``, ``pack``). The
behaviour logprobs (``inference_logprobs``) are the model's own, computed once before any
timing with ``sequence_logprobs`` under ``no_grad``, so the importance ratios start at 1.

Timed, side by side on the same model and the same AdamW optimizer (the settings of
``lachesis train``: lr 1e-5, grad-norm clip 1.0), alternating which goes first:

  * ``train_step``: ``trainer.train.train_step`` as ``lachesis train`` calls it (RL mode,
    token-mean clipped surrogate with TIS, micro-batches of ``--micro-batch-size`` 4 with
    gradient accumulation, clip, ``optimizer.step()``).
  * ``bare``: the same micro-batches through a plain loop: ``model(input_ids).logits``,
    float32 ``cross_entropy`` over the trained positions, weighted backward, the same
    clip and ``optimizer.step()``. The batch slicing and labels are prepared before
    timing. The ratio train_step/bare is the cost of the RL loss and its bookkeeping.

``--warmup`` 1 round, then ``--steps`` 5 rounds; a round is one step of each loop. On
CUDA every timed step is bracketed by ``torch.cuda.synchronize()``.

Reported per loop: ms/step (median and mean), and from the median step time (a
neighbour that steals the CPU for a step moves the mean, not the median): trained
tokens/s (mask = True positions), total tokens/s (forward and backward run over every
position) and the achieved FLOP/s over all tokens:

    model FLOPs = 6 * N * tokens
    with attention = (6 * N + 12 * L * d_attn * S) * tokens   (PaLM, appendix B)

N = the parameters that take part in matmuls: every parameter except the input embedding
table (a lookup), with the output projection counted once even when it is tied to the
input embedding. L = layers, d_attn = heads * head_dim, S = sequence length (every
sequence here is S tokens). The attention term counts the full S x S score and value
matmuls (forward 4 * S * d_attn per token and layer, backward twice that); causal kernels
skip about half of it. The log-softmax over the vocabulary and the optimizer are not
counted. MFU = achieved FLOP/s (with attention) / ``--peak-tflops`` (default 989 on CUDA,
the H100 SXM dense bf16 peak; no default on the CPU, so no MFU there).

The trainer runs with its defaults: packed micro-batches (``--micro-batch-size`` x
``--seq-len`` tokens; ``--no-packing`` for right-padded rows), chunked logprobs
(``--logprob-chunk-size``, 0 for full logits), and ``--activation-checkpointing`` when
asked. ``--model qwen2.5-1.5b|3b|7b`` build those shapes (7B untied, vocabulary 152064).
Also reported: the peak memory over both loops (``torch.cuda.max_memory_allocated`` on
CUDA, the process's peak resident set on the CPU) and, with ``--find-longest LIMIT``,
the longest single sequence (2x, 4x, ... ``--seq-len`` tokens, up to LIMIT, one micro-
batch) a training step fits, stopping at the first CUDA out-of-memory.

Run from the repo root with the project's Python:
    .venv/bin/python benchmarks/trainer_throughput.py                        # CPU: tiny model
    .venv/bin/python benchmarks/trainer_throughput.py --json out.json
    python benchmarks/trainer_throughput.py --device cuda                    # GPU: 0.5B, MFU
    python benchmarks/trainer_throughput.py --device cuda --peak-tflops 756  # H100 PCIe
    python benchmarks/trainer_throughput.py --device cuda --model qwen2.5-7b --batch-size 2 \
        --group-size 2 --micro-batch-size 1 --seq-len 4096 --activation-checkpointing \
        --find-longest 32768                                             # 7B: 16k fits?
(a CUDA build of torch is needed for the GPU mode; this project's venv is CPU-only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from environments.trajectory import MASKED, ScoredGroup, ScoredTrajectory  # noqa: E402
from trainer.batch import TrainBatch  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.logprobs import (  # noqa: E402
    attention_implementation,
    enable_activation_checkpointing,
)
from trainer.train import Batch, batch_tensors, sequence_logprobs, train_step  # noqa: E402

H100_SXM_BF16_DENSE_TFLOPS = 989.0

from lachesis.model_shapes import SHAPES, build_config  # noqa: E402

# lachesis.tiny_model's families, tied: ``tiny`` (the untied Qwen2 the quickstart uses)
# and one of each family with a tied output embedding.
TINY = ("tiny", "tiny-qwen2-tied", "tiny-qwen3-tied", "tiny-llama-tied")


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


def build_model(name: str, device: torch.device, dtype: torch.dtype, tmp: Path,
                packing: bool = True):
    """``(model, description)`` on ``device`` in ``dtype``, in train mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if name in TINY:
        from lachesis.tiny_model import make_tiny_model

        family = "qwen2" if name == "tiny" else name.split("-")[1]
        path = make_tiny_model(tmp / name, family=family, tied=name.endswith("-tied"))
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation=attention_implementation(
                device, dtype, packing))
        description = f"{name} (lachesis.tiny_model.make_tiny_model, random)"
    elif name in SHAPES:
        config = build_config(name)
        config._attn_implementation = attention_implementation(device, dtype, packing) or "sdpa"
        torch.manual_seed(0)
        with torch.device(device):  # initialise on the device: fast, no 2 GB CPU copy
            model = AutoModelForCausalLM.from_config(config)
        description = (f"{name.replace('qwen', 'Qwen')} shape ({type(model).__name__} from a "
                       f"config, random weights, {config._attn_implementation} attention)")
    else:
        raise ValueError(f"unknown model {name!r}")
    model = model.to(device=device, dtype=dtype)
    model.train()
    return model, description


def model_shape(model) -> dict:
    """Parameter counts and the shape numbers the FLOP formulas need."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings().weight
    tied = embedding is output
    # Matmul parameters: drop the input embedding (a lookup); when it is tied, the same
    # tensor is the output projection (a matmul), so it stays in.
    matmul = total if tied else total - embedding.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {
        "params_total": total,
        "params_matmul": matmul,
        "params_input_embedding": embedding.numel(),
        "tied_embeddings": tied,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "d_attn": heads * head_dim,
        "intermediate": config.intermediate_size,
        "vocab": config.vocab_size,
    }


# --------------------------------------------------------------------------- #
# Workload
# --------------------------------------------------------------------------- #


def turn_layout(seq_len: int, prompt_len: int, turns: int, tool_len: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each assistant turn: prompt, turn, tool result, turn, ..., turn."""
    sampled = seq_len - prompt_len - (turns - 1) * tool_len
    if prompt_len < 1 or turns < 1 or tool_len < 0 or sampled < turns:
        raise SystemExit(f"--seq-len {seq_len} leaves no room for --turns {turns} after "
                         f"--prompt-len {prompt_len} and --tool-len {tool_len}")
    base, extra = divmod(sampled, turns)
    spans, position = [], prompt_len
    for k in range(turns):
        n = base + (1 if k < extra else 0)
        spans.append((position, position + n))
        position += n + (tool_len if k < turns - 1 else 0)
    assert position == seq_len, (position, seq_len)
    return spans


def make_groups(args, vocab: int) -> list[ScoredGroup]:
    rng = random.Random(args.seed)
    spans = turn_layout(args.seq_len, args.prompt_len, args.turns, args.tool_len)
    trained = [False] * args.seq_len
    for start, end in spans:
        trained[start:end] = [True] * (end - start)
    groups = []
    for g in range(args.batch_size // args.group_size):
        trajectories = []
        for _ in range(args.group_size):
            tokens = [rng.randrange(vocab) for _ in range(args.seq_len)]
            trajectories.append(ScoredTrajectory(
                tokens=tokens,
                masks=[t if keep else MASKED for t, keep in zip(tokens, trained)],
                scores=[rng.random() for _ in spans],
                turn_spans=[[s, e] for s, e in spans],
                inference_logprobs=[0.0] * args.seq_len,  # replaced by the model's own below
            ))
        groups.append(ScoredGroup(group_id=f"bench-{g}", trajectories=trajectories))
    return groups


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    return [batch.slice(slice(s, s + size)) for s in range(0, len(batch.lengths), size)]


def to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    # ``sequence_logprobs`` builds its position index on the CPU and compares it with
    # ``lengths``, so ``lengths`` stays on the CPU; transformers moves the resulting 2-D
    # attention mask to the model's device.
    return TrainBatch(batch.tokens.to(device), batch.mask.to(device),
                      batch.old_logprobs.to(device), batch.advantages.to(device),
                      batch.lengths)


def with_own_logprobs(model, batch: TrainBatch, micro_batch_size: int) -> TrainBatch:
    """``batch`` with ``old_logprobs`` = the model's logprobs of its tokens (no grad)."""
    model.eval()
    with torch.no_grad():
        parts = [sequence_logprobs(model, mb.tokens, mb.lengths).float()
                 for mb in micro_batches(batch, micro_batch_size)]
    model.train()
    old = torch.where(batch.mask, torch.cat(parts), torch.zeros((), device=batch.mask.device))
    return TrainBatch(batch.tokens, batch.mask, old, batch.advantages, batch.lengths)


# --------------------------------------------------------------------------- #
# The two loops
# --------------------------------------------------------------------------- #


def prepare_bare(batch: TrainBatch, micro_batch_size: int) -> list[tuple]:
    """Per micro-batch: input ids, next-token labels (-100 where not trained), weight."""
    n_tokens = batch.n_tokens
    out = []
    for mb in micro_batches(batch, micro_batch_size):
        labels = torch.where(mb.mask, mb.tokens, torch.full_like(mb.tokens, -100))[:, 1:]
        out.append((mb.tokens, labels.reshape(-1).contiguous(), int(mb.mask.sum()) / n_tokens))
    return out


def bare_step(model, optimizer, prepared: list[tuple], max_grad_norm: float | None) -> None:
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for tokens, labels, weight in prepared:
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels,
                               ignore_index=-100)
        (loss * weight).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - started, result


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: reset the peak resident set (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_gib(device: torch.device) -> float:
    """Peak since :func:`reset_peak_memory`: allocated CUDA memory, or the process's
    peak resident set on the CPU (everything it holds: model, optimizer, batch)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def find_longest(model, optimizer, config: TrainConfig, args, device: torch.device,
                 vocab: int) -> dict:
    """One training step on one sequence of ``seq_len * 2^k`` tokens (one micro-batch),
    k = 1, 2, ... up to ``--find-longest`` tokens or the first CUDA out-of-memory."""
    attempts, longest = [], None
    seq_len = args.seq_len * 2
    while seq_len <= args.find_longest:
        one = argparse.Namespace(**{**vars(args), "seq_len": seq_len, "batch_size": 1,
                                    "group_size": 1, "prompt_len": seq_len // 4})
        settings = config.model_copy(update={
            "batch_size": 1, "micro_batch_size": 1, "max_token_length": seq_len,
            "max_tokens_per_micro_batch": max(seq_len, config.max_tokens_per_micro_batch)})
        try:
            batch, _ = batch_tensors(Batch(make_groups(one, vocab)), settings, vocab, 0)
            batch = to_device(batch, device)
            batch.old_logprobs = torch.where(batch.mask, -1.0, 0.0).to(device)
            reset_peak_memory(device)
            seconds, _ = timed(lambda b=batch, c=settings: train_step(model, optimizer, b, c),
                               device)
        except torch.cuda.OutOfMemoryError:
            attempts.append({"seq_len": seq_len, "fits": False})
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            break
        attempts.append({"seq_len": seq_len, "fits": True, "seconds": seconds,
                         "peak_memory_gib": peak_memory_gib(device)})
        print(f"  longest: {seq_len} tokens fit ({attempts[-1]['peak_memory_gib']:.2f} GiB)",
              flush=True)
        longest = seq_len
        seq_len *= 2
    return {"attempts": attempts, "longest_fitting": longest, "limit": args.find_longest}


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def loop_numbers(seconds: list[float], batch_tokens: int, trained_tokens: int,
                 flops_per_token: float, flops_per_token_attn: float,
                 peak_flops: float | None) -> dict:
    """Rates from the median step time (robust to a neighbour stealing the CPU for a step)."""
    median = statistics.median(seconds)
    tokens_per_s = batch_tokens / median
    out = {
        "step_seconds": seconds,
        "ms_per_step_median": 1000 * median,
        "ms_per_step_mean": 1000 * statistics.fmean(seconds),
        "ms_per_step_min": 1000 * min(seconds),
        "trained_tokens_per_s": trained_tokens / median,
        "total_tokens_per_s": tokens_per_s,
        "flops_per_s_6n": flops_per_token * tokens_per_s,
        "flops_per_s_6n_attn": flops_per_token_attn * tokens_per_s,
    }
    if peak_flops:
        out["mfu_6n"] = out["flops_per_s_6n"] / peak_flops
        out["mfu_6n_attn"] = out["flops_per_s_6n_attn"] / peak_flops
    return out


def print_report(report: dict) -> None:
    shape, work, loops = report["model"], report["workload"], report["loops"]
    gpu = report["device"].startswith("cuda")
    unit, scale = ("TFLOP/s", 1e12) if gpu else ("GFLOP/s", 1e9)
    print()
    print(f"model:  {report['model_description']}, {report['dtype']}, on {report['device_name']}")
    print(f"        {shape['params_total']:,} parameters ({shape['params_matmul']:,} in matmuls "
          f"= N), {shape['layers']} layers, hidden {shape['hidden']}, d_attn {shape['d_attn']}, "
          f"vocab {shape['vocab']}")
    print(f"batch:  {work['batch_size']} x {work['seq_len']} tokens = {work['batch_tokens']:,} "
          f"({work['trained_tokens']:,} trained), micro-batch {work['micro_batch_size']}, "
          f"{work['steps']} steps after {work['warmup']} warmup")
    peak = report["peak_tflops"]
    header = (f"{'loop':<11} | {'ms/step':>9} | {'mean':>9} | {'trained tok/s':>13} | "
              f"{'total tok/s':>11} | {unit + ' 6N':>13} | {unit + ' +attn':>15}")
    if peak:
        header += f" | {'MFU 6N':>7} | {'MFU +attn':>9}"
    print()
    print("ms/step: median (the rates below use it) and mean over the timed steps")
    print(header)
    print("-" * len(header))
    for name, row in loops.items():
        line = (f"{name:<11} | {row['ms_per_step_median']:>9.1f} | {row['ms_per_step_mean']:>9.1f}"
                f" | {row['trained_tokens_per_s']:>13,.0f}"
                f" | {row['total_tokens_per_s']:>11,.0f} | {row['flops_per_s_6n'] / scale:>13.3f}"
                f" | {row['flops_per_s_6n_attn'] / scale:>15.3f}")
        if peak:
            line += f" | {100 * row['mfu_6n']:>6.1f}% | {100 * row['mfu_6n_attn']:>8.1f}%"
        print(line)
    print()
    overhead = report["overhead_percent"]
    print(f"train_step / bare (tokens/s): {report['ratio_train_step_over_bare']:.3f}x; a "
          f"train_step step takes {abs(overhead):.1f}% {'longer' if overhead >= 0 else 'less'} "
          f"than a bare one (the RL loss and bookkeeping)")
    print(f"FLOPs per token: 6N = {report['flops_per_token_6n']:.4g}; with attention "
          f"6N + 12*L*d_attn*S = {report['flops_per_token_6n_attn']:.4g} "
          f"(6N alone leaves attention out)")
    if peak:
        print(f"MFU peak: {peak:g} TFLOP/s ({report['peak_source']})")
    else:
        print("MFU: not computed (no --peak-tflops given for this device)")
    m = report["train_step_last_metrics"]
    print(f"last train_step: loss {m.get('loss', 0.0):.4f}, ratio_mean "
          f"{m.get('ratio_mean', 0.0):.4f}, tis_weight_mean {m.get('tis_weight_mean', 0.0):.4f}, "
          f"approx_kl {m.get('approx_kl', 0.0):.2e}, "
          f"clip_fraction {m.get('clip_fraction', 0.0):.3f}")
    print(f"peak memory over both loops ({report['peak_memory_measure']}): "
          f"{report['peak_memory_gib']:.2f} GiB; trainer: {report['trainer']}")
    longest = report.get("longest_sequence")
    if longest:
        for attempt in longest["attempts"]:
            print(f"  one sequence of {attempt['seq_len']:>7,} tokens: "
                  + (f"fits, peak {attempt['peak_memory_gib']:.2f} GiB, "
                     f"{attempt['seconds']:.2f} s" if attempt["fits"] else "out of memory"))
        print(f"longest sequence that fits (of those tried): {longest['longest_fitting']}")
    load = report["loadavg_start"], report["loadavg_end"]
    if load[0] is not None:
        print(f"load average (1 min) at start / end: {load[0][0]:.2f} / {load[1][0]:.2f} on "
              f"{os.cpu_count()} CPUs, torch threads {report['torch_threads']}")


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Training throughput of trainer.train.train_step vs. a bare loop "
                    "(tokens/s; FLOP/s and MFU).")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="default: cuda when torch.cuda.is_available(), else cpu")
    parser.add_argument("--model", choices=[*TINY, *SHAPES],
                        help="default: qwen2.5-0.5b on cuda, tiny on cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=4,
                        help="sequences per forward/backward")
    parser.add_argument("--group-size", type=int, default=8, help="sequences per group")
    parser.add_argument("--prompt-len", type=int, default=256, help="masked prompt tokens")
    parser.add_argument("--turns", type=int, default=3, help="assistant turns (trained)")
    parser.add_argument("--tool-len", type=int, default=64,
                        help="masked tool-result tokens between two turns")
    parser.add_argument("--no-packing", action="store_true",
                        help="right-padded micro-batches of --micro-batch-size rows (default: "
                             "packed to --micro-batch-size x --seq-len tokens)")
    parser.add_argument("--max-tokens-per-micro-batch", type=int,
                        help="token budget of a packed micro-batch (default: micro-batch "
                             "size x seq len)")
    parser.add_argument("--logprob-chunk-size", type=int, default=1024,
                        help="chunked logprobs (0: full float32 logits)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--lora", type=int, metavar="RANK",
                        help="train a LoRA adapter of this rank (alpha 2*RANK, every linear "
                             "layer of the blocks) instead of every weight")
    parser.add_argument("--find-longest", type=int, metavar="LIMIT",
                        help="after the timed rounds, train one sequence of 2x, 4x, ... "
                             "--seq-len tokens (one micro-batch) up to LIMIT tokens or the "
                             "first out-of-memory on CUDA; report the longest that fits "
                             "and each one's peak memory")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--peak-tflops", type=float,
                        help=f"peak FLOP/s for MFU, in TFLOP/s (default on cuda: "
                             f"{H100_SXM_BF16_DENSE_TFLOPS:g}, H100 SXM dense bf16)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT", help="also write the numbers as JSON to OUT")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False")
    if args.model is None:
        args.model = "qwen2.5-0.5b" if args.device == "cuda" else "tiny"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.batch_size % args.group_size:
        parser.error("--batch-size must be a multiple of --group-size")
    if min(args.batch_size, args.micro_batch_size, args.seq_len, args.steps) < 1 or args.warmup < 0:
        parser.error("sizes and --steps must be positive, --warmup >= 0")
    turn_layout(args.seq_len, args.prompt_len, args.turns, args.tool_len)  # exits if it cannot
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"

    peak_tflops, peak_source = args.peak_tflops, "--peak-tflops"
    if peak_tflops is None and device.type == "cuda":
        peak_tflops = H100_SXM_BF16_DENSE_TFLOPS
        peak_source = "default: H100 SXM dense bf16; pass --peak-tflops for another GPU"
    if peak_tflops and dtype != torch.bfloat16:
        print(f"warning: MFU is against {peak_tflops:g} TFLOP/s, a bf16 peak, but the run is "
              f"{args.dtype}", file=sys.stderr)

    loadavg_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="lachesis-bench-") as tmp:
        print(f"building {args.model} on {args.device} ({args.dtype}) ...", flush=True)
        model, description = build_model(args.model, device, dtype, Path(tmp),
                                         packing=not args.no_packing)
    shape = model_shape(model)
    config = TrainConfig(
        model=args.model, mode="rl", estimator="mt_grpo", batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size, max_token_length=args.seq_len,
        dtype=args.dtype, api_url=None, tensorboard=False, check_alignment=False,
        packing=not args.no_packing,
        max_tokens_per_micro_batch=(args.max_tokens_per_micro_batch
                                    or args.micro_batch_size * args.seq_len),
        logprob_chunk_size=args.logprob_chunk_size or None,
        activation_checkpointing=args.activation_checkpointing)
    if args.lora:
        from trainer.lora import LoraSettings, apply_lora

        model = apply_lora(model, LoraSettings(rank=args.lora, alpha=2 * args.lora))
    if config.activation_checkpointing:
        enable_activation_checkpointing(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=config.lr, betas=config.betas,
                                  eps=config.adam_eps, weight_decay=config.weight_decay)

    print("building the batch (batch_tensors: checks, mt_grpo advantages, pack) ...", flush=True)
    groups = make_groups(args, shape["vocab"])
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batch, stats = batch_tensors(Batch(groups), config, shape["vocab"], pad_id)
    assert batch is not None and batch.tokens.shape == (args.batch_size, args.seq_len)
    batch = with_own_logprobs(model, to_device(batch, device), args.micro_batch_size)
    prepared = prepare_bare(batch, args.micro_batch_size)
    batch_tokens = args.batch_size * args.seq_len
    trained_tokens = batch.n_tokens

    flops_6n = 6.0 * shape["params_matmul"]
    flops_attn = flops_6n + 12.0 * shape["layers"] * shape["d_attn"] * args.seq_len
    peak_flops = peak_tflops * 1e12 if peak_tflops else None

    reset_peak_memory(device)
    times: dict[str, list[float]] = {"train_step": [], "bare": []}
    last_metrics: dict = {}
    steps = {
        "train_step": lambda: train_step(model, optimizer, batch, config),
        "bare": lambda: bare_step(model, optimizer, prepared, config.max_grad_norm),
    }
    for round_ in range(args.warmup + args.steps):
        order = ["train_step", "bare"] if round_ % 2 == 0 else ["bare", "train_step"]
        took = {}
        for name in order:
            took[name], result = timed(steps[name], device)
            if name == "train_step":
                last_metrics = result
        if round_ < args.warmup:
            label = f"warmup {round_ + 1}/{args.warmup}"
        else:
            label = f"step {round_ - args.warmup + 1}/{args.steps}"
            for name in times:
                times[name].append(took[name])
        print(f"  {label}: train_step {1000 * took['train_step']:.0f} ms, "
              f"bare {1000 * took['bare']:.0f} ms", flush=True)

    peak_memory = peak_memory_gib(device)
    loops = {name: loop_numbers(times[name], batch_tokens, trained_tokens, flops_6n,
                                flops_attn, peak_flops) for name in times}
    longest = find_longest(model, optimizer, config, args, device, shape["vocab"]) \
        if args.find_longest else None
    ratio = loops["train_step"]["total_tokens_per_s"] / loops["bare"]["total_tokens_per_s"]
    report = {
        "benchmark": "trainer_throughput",
        "device": args.device,
        "device_name": device_name,
        "dtype": args.dtype,
        "model_name": args.model,
        "model_description": description,
        "model": shape,
        "workload": {
            "batch_size": args.batch_size, "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch_size, "group_size": args.group_size,
            "prompt_len": args.prompt_len, "turns": args.turns, "tool_len": args.tool_len,
            "batch_tokens": batch_tokens, "trained_tokens": trained_tokens,
            "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
            "estimator": config.estimator, "aggregation": config.aggregation,
        },
        "loops": loops,
        "ratio_train_step_over_bare": ratio,
        "overhead_percent": 100.0 * (1.0 / ratio - 1.0),
        "flops_per_token_6n": flops_6n,
        "flops_per_token_6n_attn": flops_attn,
        "flops_formula": "6*N*tokens; with attention (6*N + 12*L*d_attn*S)*tokens; N = matmul "
                         "parameters (all but the input embedding lookup; a tied output "
                         "projection counted once)",
        "peak_tflops": peak_tflops,
        "peak_source": peak_source if peak_tflops else None,
        "train_step_last_metrics": last_metrics,
        "batch_stats": stats,
        "lora_rank": args.lora,
        "trainer": {"packing": config.packing,
                    "max_tokens_per_micro_batch": config.max_tokens_per_micro_batch,
                    "logprob_chunk_size": config.logprob_chunk_size,
                    "activation_checkpointing": config.activation_checkpointing},
        "max_memory_allocated_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                     if device.type == "cuda" else None),
        "peak_memory_gib": peak_memory,
        "peak_memory_measure": ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                                else "peak resident set of the process (VmHWM)"),
        "longest_sequence": longest,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
