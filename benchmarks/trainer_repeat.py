"""Does the trainer repeat itself? The same batch, the same starting weights, ``--steps``
trainer steps (``train_step``, AdamW) done twice; then every parameter of the two
results compared bit for bit. Once with the default kernels and once with
``train.deterministic`` (``torch.use_deterministic_algorithms``, cuBLAS's fixed
workspace), each mode in its own process (cuBLAS reads its setting when it starts), with
the step time of each mode, so the cost of determinism is measured side by side.

The workload is ``trainer_throughput.py``'s (random multi-turn rows, packed micro-batches,
mt_grpo advantages) on its model shapes (random weights built from a config):

    .venv/bin/python benchmarks/trainer_repeat.py                     # CPU, tiny model
    python benchmarks/trainer_repeat.py --device cuda --model qwen2.5-0.5b --json out.json

Per mode it prints: bit-identical or not, how many parameter elements differ and the
largest difference, ms per step; then deterministic / default step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import trainer_throughput as tt  # noqa: E402
import torch  # noqa: E402

from trainer.config import TrainConfig  # noqa: E402
from trainer.distributed import use_deterministic_kernels  # noqa: E402
from trainer.train import Batch, batch_tensors, train_step  # noqa: E402

MODES = ("default", "deterministic")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=[*tt.TINY, *tt.SHAPES], default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 16 (cpu: 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 1024 (cpu: 256)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=None, help="default: seq-len / 4")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tool-len", type=int, default=None, help="default: seq-len / 16")
    parser.add_argument("--lora", type=int, metavar="RANK", default=None)
    parser.add_argument("--steps", type=int, default=3, help="trainer steps per repeat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="default: both, side by side")
    parser.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="OUT", default=None)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.batch_size = args.batch_size or (16 if cuda else 8)
    args.seq_len = args.seq_len or (1024 if cuda else 256)
    args.prompt_len = args.prompt_len or args.seq_len // 4
    args.tool_len = args.tool_len or args.seq_len // 16
    return args


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_mode(args) -> dict:
    """In this process: ``args.steps`` steps twice from the same weights, compared."""
    deterministic = args.mode == "deterministic"
    if deterministic:
        use_deterministic_kernels()  # before the first CUDA matmul
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="lachesis-repeat-") as tmp:
        model, description = tt.build_model(args.model, device, dtype, Path(tmp))
    if args.lora:
        from trainer.lora import LoraSettings, apply_lora

        model = apply_lora(model, LoraSettings(rank=args.lora, alpha=2 * args.lora))
    config = TrainConfig(
        model=args.model, mode="rl", estimator="mt_grpo", batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size, max_token_length=args.seq_len,
        dtype=args.dtype, api_url=None, tensorboard=False, check_alignment=False,
        max_tokens_per_micro_batch=args.micro_batch_size * args.seq_len,
        deterministic=deterministic)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batch, _ = batch_tensors(Batch(tt.make_groups(args, vocab)), config, vocab, pad_id)
    batch = tt.with_own_logprobs(model, tt.to_device(batch, device), args.micro_batch_size)
    start = snapshot(model)
    results, seconds, alerts = [], [], set()
    for _ in range(2):
        model.load_state_dict(start)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=1e-4)
        for _ in range(args.steps):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                took, _ = tt.timed(lambda: train_step(model, optimizer, batch, config), device)
            alerts |= {str(w.message)[:200] for w in caught if "determinis" in str(w.message)}
            seconds.append(took)
        results.append(snapshot(model))
    first, second = results
    differing = sum(int((first[k] != second[k]).sum()) for k in first)
    largest = max(float((first[k].float() - second[k].float()).abs().max()) for k in first)
    moved = max(float((first[k].float() - start[k].float()).abs().max()) for k in first)
    return {"mode": args.mode, "model": description, "device": args.device,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "dtype": args.dtype, "steps": args.steps,
            "batch": [args.batch_size, args.seq_len], "lora": args.lora,
            "identical": differing == 0, "elements_differing": differing,
            "elements": sum(v.numel() for v in first.values()),
            "largest_difference": largest, "largest_update": moved,
            # the first step of each repeat warms up; the rest are timed
            "ms_per_step": 1000 * statistics.median(
                seconds[1:args.steps] + seconds[args.steps + 1:] or seconds),
            "warnings": sorted(alerts)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode is not None:  # a worker: one mode, its JSON on the last line
        print(json.dumps(one_mode(args)))
        return 0
    passed = list(argv if argv is not None else sys.argv[1:])
    report = {}
    for mode in args.modes:
        done = subprocess.run([sys.executable, __file__, *passed, "--mode", mode],
                              capture_output=True, text=True)
        if done.returncode != 0:
            report[mode] = {"mode": mode, "error": done.stderr.strip()[-2000:]}
        else:
            report[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        r = report[mode]
        print(f"{mode:>13}: " + (f"ERROR {r['error'][-600:]}" if "error" in r else
              f"{'identical' if r['identical'] else 'NOT identical'} after 2 x {r['steps']} "
              f"steps ({r['elements_differing']:,} of {r['elements']:,} elements differ, "
              f"largest by {r['largest_difference']:.3g}; the steps moved weights by up to "
              f"{r['largest_update']:.3g}), {r['ms_per_step']:.1f} ms per step"), flush=True)
    if len(report) == 2 and all("error" not in r for r in report.values()):
        ratio = report["deterministic"]["ms_per_step"] / report["default"]["ms_per_step"]
        report["step_time_ratio"] = ratio
        print(f"deterministic / default step time: {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all("error" not in r for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
