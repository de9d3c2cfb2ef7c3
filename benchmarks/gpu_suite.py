"""The GPU suite (``make bench-gpu``): the trainer on the shapes of the models people train,
one command, one JSON file and one markdown table.

For each model shape (random weights built from a config on the device, nothing
downloaded: Qwen2.5 0.5B, 1.5B and 3B with tied embeddings, 7B untied, Qwen3 4B tied):

- **MFU and peak memory** of the trainer's ``train_step`` at 16 x 1024 tokens (16
  multi-turn rows of 1024 tokens, packed micro-batches of 4 rows, chunked logprobs), and
  the full-weight step time; ``benchmarks/trainer_throughput.py`` measures them (its
  docstring has the FLOP formula);
- **the LoRA step time** (rank 16 on every linear layer of the blocks), same workload;
- **the longest packed micro-batch that fits** with activation checkpointing: one
  training step on one row of 2k, 4k, ... tokens up to a limit, until the first CUDA
  out-of-memory (full weights; LoRA for the shapes whose full-weight AdamW state does not
  fit the GPU);
- **the sync time into a running vLLM server**, where vLLM is installed: the trainer's
  ``PolicyServers.publish`` of the model's weights in place, in memory (vLLM's NCCL
  weight transfer on a GPU, the ``shm`` plugin backend on a CPU) and from disk.

Every measurement runs in its own process (an out-of-memory in one cannot spoil the
next) and a failure is recorded as such, never replaced by a number. Targets on one 80 GB
H100 are checked and marked in the table: 0.5B at >= 40 % MFU at 16 x 1024; 0.5B >= 64k
tokens and 7B LoRA >= 32k tokens in one micro-batch.

``--device cpu --tiny`` runs the same suite on the tiny families of
``lachesis.tiny_model`` (tied Qwen2, Qwen3 and Llama) with small sizes, in about a
minute: the test suite runs it so that this script cannot rot.

    python benchmarks/gpu_suite.py --out runs/gpu_suite          # on a CUDA machine
    .venv/bin/python benchmarks/gpu_suite.py --device cpu --tiny --out runs/gpu_suite_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
THROUGHPUT = REPO_ROOT / "benchmarks" / "trainer_throughput.py"


@dataclass
class Shape:
    model: str
    """A ``--model`` of trainer_throughput.py."""
    full: bool = True
    """Time a full-weight step (False: its AdamW state cannot fit; reported as such)."""
    longest: str = "full"
    """``full`` or ``lora``: which step the longest micro-batch is measured with."""
    limit: int = 131072
    """Longest micro-batch tried, in tokens."""
    targets: dict[str, float] = field(default_factory=dict)


GPU_SHAPES = [
    Shape("qwen2.5-0.5b", targets={"mfu": 0.40, "longest": 65536}),
    Shape("qwen2.5-1.5b"),
    Shape("qwen2.5-3b", limit=65536),
    # 7.6 B parameters: bf16 weights and grads plus float32 AdamW moments are ~90 GB.
    Shape("qwen2.5-7b", full=False, longest="lora", limit=65536,
          targets={"longest": 32768}),
    Shape("qwen3-4b", longest="lora", limit=65536),
]
TINY_SHAPES = [Shape("tiny-qwen2-tied", limit=2048), Shape("tiny-qwen3-tied", limit=2048),
               Shape("tiny-llama-tied", limit=2048)]
LORA_RANK = 16


def throughput(args, shape: Shape, out: Path, *extra: str) -> dict:
    """One trainer_throughput.py run in its own process: its JSON report, or
    ``{"error": ...}`` (an out-of-memory says so)."""
    command = [sys.executable, str(THROUGHPUT), "--device", args.device,
               "--model", shape.model, "--json", str(out), *extra]
    if args.peak_tflops:
        command += ["--peak-tflops", str(args.peak_tflops)]
    print("$", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=args.timeout)
    (out.with_suffix(".log")).write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        oom = "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr
        return {"error": "out of memory" if oom else
                f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(out.read_text())


def workload(args) -> list[str]:
    if args.tiny:
        return ["--batch-size", "4", "--group-size", "2", "--seq-len", "256",
                "--prompt-len", "64", "--tool-len", "16", "--micro-batch-size", "2",
                "--steps", "1", "--warmup", "0"]
    return ["--batch-size", "16", "--seq-len", "1024", "--micro-batch-size", "4",
            "--steps", str(args.steps), "--warmup", "1"]


def longest_workload(args) -> list[str]:
    """A cheap main loop (the number wanted is the search after it)."""
    if args.tiny:
        return ["--batch-size", "1", "--group-size", "1", "--seq-len", "256",
                "--prompt-len", "64", "--tool-len", "16", "--steps", "1", "--warmup", "0"]
    return ["--batch-size", "1", "--group-size", "1", "--seq-len", "1024", "--steps", "1",
            "--warmup", "0"]


def measure_shape(args, shape: Shape, work: Path) -> dict:
    row: dict = {"model": shape.model}
    if shape.full:
        full = throughput(args, shape, work / f"{shape.model}-full.json", *workload(args))
        row["full"] = full
    else:
        row["full"] = {"error": "not run: the full-weight AdamW state does not fit one GPU"}
    row["lora"] = throughput(args, shape, work / f"{shape.model}-lora.json", *workload(args),
                             "--lora", str(LORA_RANK))
    extra = ["--activation-checkpointing", "--find-longest", str(shape.limit)]
    if shape.longest == "lora":
        extra += ["--lora", str(LORA_RANK)]
    row["longest"] = throughput(args, shape, work / f"{shape.model}-longest.json",
                                *longest_workload(args), *extra)
    row["longest_mode"] = shape.longest
    row["sync"] = sync_times(args, shape, work) if args.sync else {"error": "not asked"}
    row["targets"] = shape.targets
    return row


def sync_times(args, shape: Shape, work: Path) -> dict:
    """Seconds to put the model's weights into a running vLLM server (in memory, and
    from disk), or why not measured."""
    if importlib.util.find_spec("vllm") is None:
        return {"error": "vLLM is not installed"}
    command = [sys.executable, __file__, "--sync-worker", shape.model, "--device", args.device,
               "--json", str(work / f"{shape.model}-sync.json"),
               *(["--vllm-url", args.vllm_url] if args.vllm_url else [])]
    print("$", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=args.timeout)
    (work / f"{shape.model}-sync.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads((work / f"{shape.model}-sync.json").read_text())


def sync_worker(model_name: str, device_name: str, out: Path, rounds: int = 3,
                vllm_url: str | None = None) -> None:
    """Build the shape, save it, serve it with vLLM (or use the server at ``vllm_url``,
    which must serve these weights and accept transfers), then time ``rounds`` in-memory
    syncs and one disk sync of perturbed weights into it, each followed by the post-sync
    check, which fails the run if vLLM does not serve the new weights. A server it did
    not start gets the original weights back."""
    import contextlib

    import torch

    sys.path.insert(0, str(REPO_ROOT))
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from trainer_throughput import build_model

    from environments.inference.vllm_process import VLLMProcess
    from trainer.config import TrainConfig
    from trainer.vllm_sync import PolicyServers, vllm_options

    device = torch.device(device_name)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    with tempfile.TemporaryDirectory(prefix="lachesis-sync-") as tmp:
        tmp = Path(tmp)
        model, _ = build_model(model_name, device, dtype, tmp)
        model.eval()
        model.save_pretrained(tmp / "model")
        tokenizer = (tmp / model_name).exists()
        if tokenizer:  # a tiny model: its tokenizer too
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tmp / model_name).save_pretrained(tmp / "model")
        config = TrainConfig(model=str(tmp / "model"), run_dir=tmp / "run",
                             weight_sync="transfer", tensorboard=False,
                             dtype="bfloat16" if gpu else "float32")
        args, env = vllm_options(config)
        server = contextlib.nullcontext() if vllm_url else VLLMProcess(
            tmp / "model", served_model_name="bench", max_model_len=1024, dev_mode=True,
            dtype="bfloat16" if gpu else "float32",
            gpu_memory_utilization=0.35 if gpu else 0.3, enforce_eager=not gpu, env=env,
            # token ids in and out: a shape without a tokenizer serves too
            extra_args=[*args, *([] if tokenizer else ["--skip-tokenizer-init"])],
            log_path=tmp / "vllm.log")
        original = {k: v.clone() for k, v in model.state_dict().items()}
        results: dict = {"transfer_seconds": [], "disk_seconds": []}

        async def publish(method: str, version: int, scale: float = 1.001) -> float:
            servers = PolicyServers(config.model_copy(update={"weight_sync": method}),
                                    tmp / "run", check_sync=False)
            await servers.start()
            try:
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.mul_(scale)
                started = time.monotonic()
                await servers.publish(model, None, version, None)
                seconds = time.monotonic() - started
                results.setdefault("check_mean_abs_diff", []).append(
                    await servers.verify(model))  # raises if vLLM did not get them
                return seconds
            finally:
                await servers.stop()

        with server:
            url = vllm_url or server.url
            config = config.model_copy(update={"vllm_urls": [url]})
            try:
                for version in range(1, rounds + 1):
                    results["transfer_seconds"].append(asyncio.run(publish("transfer", version)))
                results["disk_seconds"].append(asyncio.run(publish("disk", rounds + 1)))
            finally:
                if vllm_url:  # not ours: its weights as they were
                    model.load_state_dict(original)
                    asyncio.run(publish("disk", rounds + 2, scale=1.0))
        results["backend"] = "nccl" if gpu else "shm"
        results["parameters"] = sum(p.numel() for p in model.parameters())
    out.write_text(json.dumps(results, indent=2) + "\n")


def cell(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def table(report: dict) -> str:
    rows = report["shapes"]
    work = next((r[k]["workload"] for r in rows for k in ("full", "lora")
                 if "workload" in r[k]), {"batch_size": "?", "seq_len": "?"})
    size = f"{work['batch_size']}x{work['seq_len']}"
    head = (f"| model | params | tied | MFU {size} | peak GiB | full step s | LoRA step s | "
            "longest micro-batch (ckpt) | sync s in memory / disk |\n"
            "|---|---:|:-:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for row in rows:
        full, lora, longest, sync = row["full"], row["lora"], row["longest"], row["sync"]
        base = full if "error" not in full else lora
        shape = base.get("model", {})
        step = full.get("loops", {}).get("train_step", {})
        lora_step = lora.get("loops", {}).get("train_step", {})
        mfu = step.get("mfu_6n_attn")
        target = row["targets"]
        mfu_text = "error" if "error" in full and row["model"] != "qwen2.5-7b" else \
            cell(mfu, ".1%", "n/a" if "error" not in full else "-")
        if mfu is not None and "mfu" in target:
            mfu_text += " ✓" if mfu >= target["mfu"] else f" ✗ (target {target['mfu']:.0%})"
        fits = longest.get("longest_sequence", {}) or {}
        longest_text = longest.get("error") or \
            f"{fits.get('longest_fitting') or 'none'} ({row['longest_mode']})"
        if "longest" in target and "error" not in longest:
            ok = (fits.get("longest_fitting") or 0) >= target["longest"]
            longest_text += " ✓" if ok else f" ✗ (target {target['longest']})"
        if "error" in sync:
            sync_text = sync["error"]
        else:
            sync_text = (f"{min(sync['transfer_seconds']):.3f} ({sync['backend']}) / "
                         f"{min(sync['disk_seconds']):.3f}")
        lines.append(
            f"| {row['model']} | {cell(shape.get('params_total'), ',')} | "
            f"{'yes' if shape.get('tied_embeddings') else 'no'} | {mfu_text} | "
            f"{cell(full.get('peak_memory_gib'), '.1f', full.get('error', '-'))} | "
            f"{cell(step.get('ms_per_step_median') and step['ms_per_step_median'] / 1000, '.3f', full.get('error', '-'))} | "
            f"{cell(lora_step.get('ms_per_step_median') and lora_step['ms_per_step_median'] / 1000, '.3f', lora.get('error', '-'))} | "
            f"{longest_text} | {sync_text} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny model families and small sizes (for a CPU)")
    parser.add_argument("--models", help="comma-separated subset of the shapes to run")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_suite"),
                        help="folder for suite.json, suite.md and each run's JSON and log")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--peak-tflops", type=float,
                        help="the GPU's dense bf16 peak (default: trainer_throughput's, H100 "
                             "SXM)")
    parser.add_argument("--no-sync", dest="sync", action="store_false",
                        help="skip the vLLM sync times")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per measurement")
    parser.add_argument("--vllm-url",
                        help="sync into this running vLLM server instead of starting one "
                             "(one shape only; it must serve that shape's weights, e.g. the "
                             "tests' tiny tied Qwen2, and accept in-memory transfers); it gets "
                             "its weights back at the end")
    parser.add_argument("--sync-worker", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sync_worker:
        sync_worker(args.sync_worker, args.device, args.json, vllm_url=args.vllm_url)
        return 0
    if args.device == "cuda" and args.tiny:
        parser.error("--tiny is the CPU mode: use it with --device cpu")
    if args.device == "cpu" and not args.tiny:
        parser.error("the full shapes need a GPU: use --device cpu --tiny on a CPU")
    shapes = TINY_SHAPES if args.tiny else GPU_SHAPES
    if args.models:
        wanted = args.models.split(",")
        unknown = set(wanted) - {s.model for s in shapes}
        if unknown:
            parser.error(f"--models: unknown {sorted(unknown)}; these are "
                         f"{[s.model for s in shapes]}")
        shapes = [s for s in shapes if s.model in wanted]
    if args.vllm_url and len(shapes) != 1:
        parser.error("--vllm-url serves one model: name its shape with --models")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = [measure_shape(args, shape, args.out) for shape in shapes]
    import torch

    report = {
        "suite": "gpu_suite", "device": args.device, "tiny": args.tiny,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else
        f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__, "lora_rank": LORA_RANK,
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "seconds": time.monotonic() - started, "shapes": rows,
    }
    (args.out / "suite.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = table(report)
    (args.out / "suite.md").write_text(markdown)
    print(markdown)
    print(f"written: {args.out / 'suite.json'}, {args.out / 'suite.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
