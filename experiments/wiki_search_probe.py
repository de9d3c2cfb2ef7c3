"""A zero-shot probe of a model on ``wiki_search``: how often it calls the tool, how often
it answers exactly, and what an episode costs, at each horizon.

    python experiments/wiki_search_probe.py --items 16 --temperatures 0 1

Starts one vLLM CPU server on ``--model`` (default: the packaged SmolLM2-135M-Instruct,
converted on first use), plays ``--items`` held-out items of each horizon once per
temperature (``evaluate``: one episode per item, all at once), and prints per horizon and
temperature: the episodes' rates (tool call made, tool success, answer in a search
result, exact match), mean turns, mean sampled tokens, and the wall seconds of the whole
batch and per episode. Each batch's episodes go to ``--out``/``HORIZON-tT.jsonl``
(``lachesis inspect`` reads them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from environments.envs.wiki_search import WikiSearchConfig, WikiSearchEnv  # noqa: E402
from environments.inference.packaged_models import resolve_model  # noqa: E402
from environments.inference.vllm_process import VLLMProcess  # noqa: E402


def episodes(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        group = json.loads(line)
        for trajectory in group["trajectories"]:
            metrics = trajectory.get("metadata", {}).get("metrics", {})
            rows.append({"metrics": metrics,
                         "sampled": sum(m != -100 for m in trajectory["masks"]),
                         "turns": len(trajectory.get("turn_spans") or []) or 1})
    return rows


async def probe(url: str, model_dir: str, horizon: str, temperature: float, items: int,
                max_tokens_per_turn: int, out: Path) -> dict[str, Any]:
    config = WikiSearchConfig(horizon=horizon, eval_items=items,
                              eval_temperature=temperature, inference_servers=[url],
                              tokenizer=model_dir, max_tokens_per_turn=max_tokens_per_turn,
                              eval_out=out, api_token=None)
    env = WikiSearchEnv(config)
    await env.start()
    try:
        began = time.monotonic()
        metrics = await env.evaluate()
        seconds = time.monotonic() - began
    finally:
        await env.close()
    rows = episodes(out)
    n = len(rows)
    rate = lambda key: round(sum(r["metrics"].get(key, 0.0) > 0 for r in rows) / n, 3)  # noqa: E731
    return {"horizon": horizon, "temperature": temperature, "episodes": n,
            "failed": metrics["failed"], "tool_call_rate": rate("tool_calls"),
            "tool_success": rate("tool_success"), "answer_in_result": rate("answer_in_result"),
            "exact_match": rate("exact_match"), "direct_answer": rate("direct_answer"),
            "mean_turns": round(sum(r["turns"] for r in rows) / n, 2),
            "mean_sampled_tokens": round(sum(r["sampled"] for r in rows) / n, 1),
            "mean_outcome": round(metrics["mean_outcome"], 3),
            "batch_seconds": round(seconds, 1), "seconds_per_episode": round(seconds / n, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--horizons", nargs="+", default=["one_hop", "two_hop"])
    parser.add_argument("--max-tokens-per-turn", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("runs/wiki-search-probe"))
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    server = VLLMProcess(model_dir, max_model_len=4096, log_path=args.out / "vllm.log")
    began = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout=300)
        print(json.dumps({"vllm_ready_seconds": round(time.monotonic() - began, 1)}), flush=True)
        for horizon in args.horizons:
            for temperature in args.temperatures:
                out = args.out / f"{horizon}-t{temperature:g}.jsonl"
                out.unlink(missing_ok=True)
                print(json.dumps(asyncio.run(probe(
                    server.url, model_dir, horizon, temperature, args.items,
                    args.max_tokens_per_turn, out))), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
