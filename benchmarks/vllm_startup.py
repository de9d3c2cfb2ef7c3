"""A vLLM CPU server's start, two ways side by side in one run, alternating (``--modes``):

- ``spawn``: its engine core spawned (vLLM's CPU default), against ``fork``: forked
  (``python -m environments.inference.vllm_serve``, what every Lachesis server runs);
- ``compiled-helpers``: forked, with vLLM's compiled helpers compiling at the first request
  for logprobs (``TORCHDYNAMO_DISABLE=0``), against ``fork``, where they run eagerly.

Per start: seconds to ``/health`` answering, seconds to the first completion (with
logprobs, as every rollout asks), the CPU seconds its processes took by then (the API
server and engine core, read from /proc while they run), then the decode speed of the
running server (64 concurrent completions of 128 tokens at temperature 0, three times: the
median tokens per second) and whether both ways gave the same texts. Model: the test
suite's tiny Qwen2 (``lachesis.tiny_model``), built locally.

    python benchmarks/vllm_startup.py [--modes fork,spawn] [--rounds 2] [--json OUT]
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from environments.inference.vllm_process import VLLMProcess  # noqa: E402
from lachesis.run.processes import tree_cpu_seconds  # noqa: E402

MODES = {"spawn": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "TORCHDYNAMO_DISABLE": "1"},
         "fork": {}, "compiled-helpers": {"TORCHDYNAMO_DISABLE": "0"}}
"""``spawn`` in the environment keeps vLLM's own choice, ``TORCHDYNAMO_DISABLE=0`` its
compiled helpers (environments/inference/vllm_serve.py, which changes nothing where spawn
is asked: ``spawn`` turns the helpers' compile off itself, so that only the start method
differs from ``fork``)."""


async def completions(url: str, n: int, max_tokens: int, logprobs: int | None = None
                      ) -> tuple[float, list[str]]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> dict:
            body = {"model": "tiny", "prompt": f"item {i}:", "max_tokens": max_tokens,
                    "min_tokens": max_tokens, "temperature": 0.0, "logprobs": logprobs}
            async with session.post(url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                return await response.json()

        start = time.monotonic()
        answers = await asyncio.gather(*(one(i) for i in range(n)))
        seconds = time.monotonic() - start
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return tokens / seconds, [a["choices"][0]["text"] for a in answers]


def one_start(model: Path, mode: str, log_dir: Path) -> dict:
    server = VLLMProcess(model, served_model_name="tiny", max_model_len=1024,
                         env=MODES[mode], log_path=log_dir / f"{mode}.log")
    start = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout=600, poll=0.1)
        ready_s = time.monotonic() - start
        asyncio.run(completions(server.url, 1, 1, logprobs=0))
        first_s = time.monotonic() - start
        cpu_s = tree_cpu_seconds(server.proc.pid, reaped=True)  # (what they reaped too)
        batches = [asyncio.run(completions(server.url, 64, 128)) for _ in range(3)]
        tokens_per_s, texts = statistics.median(b[0] for b in batches), batches[0][1]
    finally:
        server.stop()
    return {"ready_s": ready_s, "first_completion_s": first_s, "cpu_s": cpu_s,
            "decode_tokens_per_s": tokens_per_s, "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="fork,spawn",
                        help="two of " + ", ".join(MODES) + " (the first over the second)")
    parser.add_argument("--rounds", type=int, default=2, help="starts per mode")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if len(modes) != 2 or not set(modes) <= set(MODES) or modes[0] == modes[1]:
        parser.error(f"--modes {args.modes}: two different ones of {', '.join(MODES)}")
    new, base = modes
    from lachesis.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="vllm-startup-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", seed=0, tied=True)
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for k in range(args.rounds):
            for mode in (modes if k % 2 == 0 else modes[::-1]):
                runs[mode].append(one_start(model, mode, Path(tmp)))
                r = runs[mode][-1]
                print(f"{mode:16s}: ready {r['ready_s']:5.1f} s, first completion "
                      f"{r['first_completion_s']:5.1f} s, CPU {r['cpu_s']:5.1f} s, decode "
                      f"{r['decode_tokens_per_s']:6.0f} tokens/s", flush=True)
    keys = ("ready_s", "first_completion_s", "cpu_s", "decode_tokens_per_s")
    result = {mode: {key: statistics.median(r[key] for r in rs) for key in keys}
              for mode, rs in runs.items()}
    same = all(r["texts"] == runs[base][0]["texts"] for rs in runs.values() for r in rs)
    result["same_texts"] = same
    result[f"{new}_over_{base}"] = {key: result[new][key] / result[base][key] for key in keys}
    print(f"medians of {args.rounds}: "
          + "; ".join(f"{key} {new}/{base} {v:.2f}"
                      for key, v in result[f"{new}_over_{base}"].items())
          + f"; same texts at temperature 0: {same}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
