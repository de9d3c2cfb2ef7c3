"""A zero-shot probe of a model on ``wiki_search``: how often it calls the tool, how often
it answers exactly, and what an episode costs, at each horizon.

    python experiments/wiki_search_probe.py --items 16 --temperatures 0 1

Starts one vLLM CPU server on ``--model`` (default: the packaged SmolLM2-135M-Instruct,
converted on first use), plays ``--items`` held-out items of each horizon once per
temperature (``evaluate``: one episode per item, all at once), and prints per horizon and
temperature: the episodes' rates (tool call made, tool success, answer in a search
result, exact match, and, outside the rewards, the final reply holding an answer
anywhere, tags or not), mean turns, mean sampled tokens, and the wall seconds of the whole
batch and per episode. ``--example`` appends a one-hop and a two-hop demonstration of
training items (:data:`EXAMPLES`, their real results shortened to the sentences that
matter) to the system prompt; ``--few-shot N`` sets the env's ``few_shot`` (N
demonstrations as earlier turns of the conversation). Each batch's episodes go to ``--out``/``HORIZON-tT.jsonl``
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


EXAMPLES = ["wiki1-afghanistan", "wiki2-abidjan"]
"""Training items whose demonstrations ``--example`` writes into the system prompt."""


def shorten(result: str, keep: list[str]) -> str:
    """A search result cut to its title, its first sentence and the sentences naming one
    of ``keep`` (the answer, the bridge country)."""
    import re

    title, _, text = result.partition("\n")
    sentences = re.split(r"(?<=[.!?]) +", text)
    chosen = [s for i, s in enumerate(sentences)
              if i == 0 or any(k.lower() in s.lower() for k in keep)]
    return f"{title}: {' '.join(chosen)}" + (" ..." if len(chosen) < len(sentences) else "")


def example_prompt() -> str:
    """The env's system prompt followed by the demonstrations of :data:`EXAMPLES` (their
    real search results shortened, :func:`shorten`), as text."""
    env = WikiSearchEnv(WikiSearchConfig(horizon="two_hop"))
    env.load_data()
    one = WikiSearchEnv(WikiSearchConfig(horizon="one_hop"))
    one.load_data()
    items = {i["id"]: i for i in env.train_items + one.train_items}
    lines = [env.config.system_prompt, "", "Examples:"]
    for item_id in EXAMPLES:
        item = items[item_id]
        for message in env.oracle_messages(item)[1:]:
            text = message["content"]
            if message["role"] == "tool":
                text = ("<tool_response>" + shorten(text, [*item["answers"], *(
                    [item["country"]] if item["horizon"] == "two_hop" else [])])
                        + "</tool_response>")
            lines.append(f"{'Assistant' if message['role'] == 'assistant' else 'User'}: "
                         f"{text}")
        lines.append("")
    return "\n".join(lines).rstrip()


def episodes(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        group = json.loads(line)
        answers = [a.lower() for a in group.get("metadata", {}).get("answers", [])]
        for trajectory in group["trajectories"]:
            metrics = trajectory.get("metadata", {}).get("metrics", {})
            replies = [m["content"] for m in trajectory.get("messages") or []
                       if m["role"] == "assistant"]
            rows.append({"metrics": metrics, "item_id": group.get("item_id"),
                         "sampled": sum(m != -100 for m in trajectory["masks"]),
                         "turns": len(trajectory.get("turn_spans") or []) or 1,
                         "final": replies[-1] if replies else ""})
    return rows


def answer_anywhere(rows: list[dict[str, Any]], answers: dict[str, list[str]]) -> int:
    """How many episodes (:func:`episodes` rows, any number per item) end with a reply
    holding one of their own item's answers anywhere, tags or not."""
    return sum(any(a.lower() in row["final"].lower() for a in answers[row["item_id"]])
               for row in rows)


async def probe(url: str, model_dir: str, horizon: str, temperature: float, items: int,
                max_tokens_per_turn: int, out: Path, system_prompt: str | None,
                few_shot: int = 0) -> dict[str, Any]:
    config = WikiSearchConfig(horizon=horizon, eval_items=items,
                              eval_temperature=temperature, inference_servers=[url],
                              tokenizer=model_dir, max_tokens_per_turn=max_tokens_per_turn,
                              eval_out=out, api_token=None, few_shot=few_shot,
                              **({"system_prompt": system_prompt} if system_prompt else {}))
    env = WikiSearchEnv(config)
    await env.start()
    try:
        began = time.monotonic()
        metrics = await env.evaluate()
        seconds = time.monotonic() - began
        answers = {i["id"]: i["answers"] for i in await env.eval_items()}
    finally:
        await env.close()
    rows = episodes(out)
    n = len(rows)
    anywhere = answer_anywhere(rows, answers)
    rate = lambda key: round(sum(r["metrics"].get(key, 0.0) > 0 for r in rows) / n, 3)  # noqa: E731
    return {"horizon": horizon, "temperature": temperature, "episodes": n,
            "failed": metrics["failed"], "tool_call_rate": rate("tool_calls"),
            "tool_success": rate("tool_success"), "answer_in_result": rate("answer_in_result"),
            "exact_match": rate("exact_match"), "direct_answer": rate("direct_answer"),
            "mean_turns": round(sum(r["turns"] for r in rows) / n, 2),
            "mean_sampled_tokens": round(sum(r["sampled"] for r in rows) / n, 1),
            "answer_anywhere_in_reply": round(anywhere / n, 3),
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
    parser.add_argument("--example", action="store_true",
                        help="a one-hop and a two-hop demonstration in the system prompt")
    parser.add_argument("--few-shot", type=int, default=0,
                        help="the env's few_shot: demonstrations as earlier turns")
    args = parser.parse_args()
    system_prompt = example_prompt() if args.example else None
    if system_prompt:
        print(json.dumps({"system_prompt": system_prompt}), flush=True)
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
                    args.max_tokens_per_turn, out, system_prompt, args.few_shot))),
                    flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
