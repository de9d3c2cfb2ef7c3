"""How long a trainer checkpoint takes: ``trainer.checkpoint.save_checkpoint`` as the
trainer calls it (weights, tokenizer, optimizer state, RNG, every file fsynced, manifest,
rename) for full fine-tuning and for a LoRA adapter, and how long finding and verifying
the newest checkpoint takes on resume (``latest_checkpoint``).

Models: a shape of ``lachesis.model_shapes`` (random weights, nothing downloaded; bfloat16
on CUDA, float32 on the CPU unless ``--dtype``), ``tiny`` (the tests' tiny model), or a
model directory (e.g. ``runs/quickstart/warm_start/final``). The optimizer is AdamW with its state present (one step taken), as in a run.

    .venv/bin/python benchmarks/checkpoint_time.py --shape tiny --out /tmp/ckpt
    python benchmarks/checkpoint_time.py --shape qwen2.5-0.5b qwen2.5-1.5b --out /tmp/ckpt

Prints one row per (shape, kind): bytes written and seconds (median of ``--repeats``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.checkpoint import latest_checkpoint, save_checkpoint  # noqa: E402


def build(shape: str, dtype: torch.dtype, device: str, work: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lachesis.tiny_model import make_tiny_model

    if Path(shape).is_dir():
        return (AutoModelForCausalLM.from_pretrained(shape, dtype=dtype).to(device),
                AutoTokenizer.from_pretrained(shape))
    tiny = make_tiny_model(work / "tiny-model", seed=0, tied=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    if shape == "tiny":
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=dtype)
    else:
        from lachesis.model_shapes import build_config

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(build_config(shape), dtype=dtype)
    return model.to(device), tokenizer


def with_state(model) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, its moments allocated (one step taken)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return optimizer


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(model, tokenizer, run_dir: Path, repeats: int) -> tuple[float, float, int]:
    optimizer = with_state(model)
    seconds, load_seconds, written = [], [], 0
    for step in range(1, repeats + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        path = save_checkpoint(run_dir, step, model, optimizer.state_dict(), tokenizer,
                               keep=2)
        seconds.append(time.perf_counter() - started)
        written = size(path)
        started = time.perf_counter()
        assert latest_checkpoint(run_dir) == path
        load_seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), statistics.median(load_seconds), written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", nargs="+", default=["tiny"],
                        help="shapes of lachesis.model_shapes, tiny, or model directories")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="where checkpoints are written (a disk "
                        "like the run's; default: a temporary directory)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    work = Path(tempfile.mkdtemp(dir=args.out))
    rows = []
    try:
        for shape in args.shape:
            model, tokenizer = build(shape, dtype, args.device, work)
            params = sum(p.numel() for p in model.parameters())
            name = Path(shape).name
            full = measure(model, tokenizer, work / f"{name}-full", args.repeats)
            shutil.rmtree(work / f"{name}-full")
            from trainer.lora import LoraSettings, apply_lora

            lora_model = apply_lora(model, LoraSettings(rank=args.lora_rank,
                                                        alpha=2.0 * args.lora_rank))
            lora = measure(lora_model, tokenizer, work / f"{name}-lora", args.repeats)
            shutil.rmtree(work / f"{name}-lora")
            for kind, (save_s, verify_s, written) in (("full", full),
                                                      (f"lora r={args.lora_rank}", lora)):
                rows.append({"shape": name, "params": params, "dtype": str(dtype),
                             "device": args.device, "kind": kind, "bytes": written,
                             "save_s": save_s, "verify_s": verify_s})
            del model, lora_model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'shape':14} {'params':>8} {'kind':10} {'written':>10} {'save':>8} "
          f"{'verify':>8}   ({args.device}, {str(dtype).removeprefix('torch.')}, median of "
          f"{args.repeats})")
    for r in rows:
        print(f"{r['shape']:14} {r['params'] / 1e6:>7.1f}M {r['kind']:10} "
              f"{r['bytes'] / 2**20:>8.1f}MiB {r['save_s']:>7.2f}s {r['verify_s']:>7.2f}s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
