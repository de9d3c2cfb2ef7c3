"""Weight sync into a running vLLM server: disk reload vs. in-memory transfer vs. LoRA
adapter, side by side in one run.

What is timed, per sync: from "the optimizer step is done" (the trainer's weights are new)
to "every vLLM server generates with the new weights": ``PolicyServers.publish`` (the
trainer's own code path) followed by one 1-token completion under the name the new
weights are served as. Between syncs every trained weight moves a little (untimed), so
each sync carries new values. One warm-up sync per method is not counted (the transfer's
is the handshake); then ``--syncs`` timed syncs, median reported.

- ``disk``: ``save_pretrained`` (safetensors) + ``/collective_rpc reload_weights``, inside
  ``/pause``..``/resume``;
- ``transfer``: vLLM's weight-transfer API (``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) with the state dict going through the ``shm`` backend (a
  shared-memory file; ``--transfer-backend gloo``: a gloo broadcast over TCP)
  (``environments.inference.weight_transfer``), inside ``/pause``..``/resume``;
- ``lora``: the adapter (rank 8 on q/k/v/o and the MLP) saved and hot-loaded with
  ``/v1/load_lora_adapter`` under a new versioned name.

Models, both Qwen2-shaped with random weights (``lachesis.tiny_model.make_tiny_model``,
byte tokenizer, no hub download), float32:

- ``tiny``: 2 layers, hidden 128 (the test model);
- ``large``: 10 layers, hidden 1024, MLP 2816, 16 heads of 64, 2 KV heads: ~112 M
  parameters (~450 MB).

One vLLM CPU server per model, started with LoRA and weight transfer both enabled (so all
three methods run against the same server). Targets: transfer >= 3x faster than disk on
the large model; LoRA sync <= 0.5 s.

Run from the repo root with the project's Python:
    python benchmarks/weight_sync.py [--syncs 5] [--models tiny,large] [--json OUT]
                                     [--transfer-backend shm|gloo]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402
import torch  # noqa: E402

MODELS = {
    "tiny": {},
    "large": {"hidden_size": 1024, "num_layers": 10, "intermediate_size": 2816,
              "num_heads": 16, "num_kv_heads": 2},
}


def nudge(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Stands in for an optimizer step: every trainable weight moves a little."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-3)


async def generate(url: str, model_name: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={
                "model": model_name, "prompt": [1, 2, 3], "max_tokens": 1}) as response:
            if response.status != 200:
                raise RuntimeError(f"{model_name}: {response.status} {await response.text()}")


async def time_method(method: str, model, tokenizer, server, run_dir: Path, syncs: int,
                      seed: int, backend: str) -> list[float]:
    from trainer.config import TrainConfig
    from trainer.vllm_sync import PolicyServers

    settings = {"weight_sync": method}
    if method == "lora":
        settings["lora"] = {"rank": 8}
    config = TrainConfig(model=str(server.model_dir), vllm_urls=[server.url],
                         run_dir=run_dir / method, tensorboard=False, check_sync=False,
                         transfer_backend=backend, **settings)
    servers = PolicyServers(config, config.run_dir)
    await servers.start()
    generator = torch.Generator().manual_seed(seed)
    seconds = []
    try:
        for version in range(1, syncs + 2):
            nudge(model, generator)
            started = time.perf_counter()
            values = await servers.publish(model, tokenizer, version, None)
            await generate(server.url, servers.model_name or server.model_name)
            elapsed = time.perf_counter() - started
            if "sync_fallbacks" in values:
                raise RuntimeError(f"{method}: the transfer fell back to disk: {values}")
            if version > 1:  # the first is the warm-up (the transfer's handshake)
                seconds.append(elapsed)
    finally:
        await servers.stop()
    return seconds


def bench_model(name: str, work: Path, syncs: int, backend: str) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from environments.inference.vllm_process import VLLMProcess
    from lachesis.tiny_model import make_tiny_model
    from trainer.lora import LoraSettings, apply_lora
    from trainer.lora import vllm_options as lora_options
    from trainer.vllm_transfer import vllm_options as transfer_options

    model_dir = make_tiny_model(work / name, seed=0, **MODELS[name])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    lora_args, lora_env = lora_options(LoraSettings(rank=8))
    transfer_args, transfer_env = transfer_options(backend)
    server = VLLMProcess(model_dir, served_model_name=name, max_model_len=512, dev_mode=True,
                         extra_args=[*lora_args, *transfer_args],
                         env={**lora_env, **transfer_env}, log_path=work / f"vllm-{name}.log")
    rows = []
    with server:
        asyncio.run(generate(server.url, name))  # the first request warms vLLM up
        for i, method in enumerate(("disk", "transfer", "lora")):
            if method == "lora":  # the base model frozen, an adapter on top
                model = apply_lora(model, LoraSettings(rank=8))
            seconds = asyncio.run(time_method(method, model, tokenizer, server, work / name,
                                              syncs, seed=i, backend=backend))
            rows.append({"model": name, "params": params, "method": method,
                         **({"backend": backend} if method == "transfer" else {}),
                         "median_s": statistics.median(seconds), "min_s": min(seconds),
                         "max_s": max(seconds), "syncs": len(seconds)})
            print(f"  {name} {method}: median {rows[-1]['median_s']:.3f} s "
                  f"({', '.join(f'{s:.3f}' for s in seconds)})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs per method")
    parser.add_argument("--models", default="tiny,large")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--transfer-backend", choices=["shm", "gloo"], default="shm",
                        help="the CPU backend of the in-memory transfer")
    args = parser.parse_args()
    if args.syncs < 1:
        parser.error("--syncs must be at least 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as work:
        for name in args.models.split(","):
            if name not in MODELS:
                parser.error(f"--models: {name!r} is not one of {', '.join(MODELS)}")
            rows += bench_model(name, Path(work), args.syncs, args.transfer_backend)

    print(f"\n{'model':<6} {'params':>12} {'method':<9} {'median s':>9} {'min s':>8} "
          f"{'max s':>8}  vs disk")
    for row in rows:
        disk = next(r["median_s"] for r in rows
                    if r["model"] == row["model"] and r["method"] == "disk")
        print(f"{row['model']:<6} {row['params']:>12,} {row['method']:<9} "
              f"{row['median_s']:>9.3f} {row['min_s']:>8.3f} {row['max_s']:>8.3f}  "
              f"{disk / row['median_s']:.1f}x faster")
    if args.json:
        args.json.write_text(json.dumps({"results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
