"""The env framework's own CPU per turn, without the inference server: recorded quickstart
groups replayed through ``ArithmeticToolEnv.collect_group``.

A backend stands in for vLLM and hands each rollout the turns a real run sampled (token
ids and logprobs, from a run's ``trajectories/arithmetic_tool.jsonl``), so everything
the env server does for a turn runs for real and nothing else: rendering the prompt and
each continuation with the chat template and tokenizing it, decoding the sampled ids,
parsing tool calls, running the calculator, the turn rewards, the metrics and the
trajectory checks. It also times the request's JSON (what the HTTP client encodes and
decodes per turn, ``VLLMServerPool``'s payload and a generate-route answer of the same
size). Prints milliseconds of CPU per turn and per episode.

    .venv/bin/python benchmarks/env_turn_cpu.py runs/quickstart
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from environments.envs.arithmetic_tool import ArithmeticToolEnv  # noqa: E402
from environments.inference.backends import VLLMBackend  # noqa: E402
from environments.inference.chat_template import ChatRenderer  # noqa: E402
from environments.inference.vllm_client import Completion  # noqa: E402


class ReplayPool:
    """Stands in for ``VLLMServerPool``: each prompt gets the next recorded turn of a
    recorded rollout that has exactly this context."""

    def __init__(self, turns: dict[tuple[int, ...], list[tuple[list[int], list[float]]]]):
        self.turns = turns

    async def complete(self, prompt_ids: list[int], *, max_tokens: int,
                       sampling: dict[str, Any] | None = None) -> Completion:
        ids, logprobs = self.turns[tuple(prompt_ids)].pop()
        return Completion(list(ids), list(logprobs), "stop", None, "replay")


def load_groups(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def replay(run_dir: Path, limit: int) -> dict[str, Any]:
    config = yaml.safe_load((run_dir / "configs" / "env-arithmetic_tool.yaml").read_text())
    settings = config.get("env", config)
    env = ArithmeticToolEnv(ArithmeticToolEnv.config_class.model_validate(
        {k: v for k, v in settings.items() if k in ArithmeticToolEnv.config_class.model_fields}
        | {"keep_equal_score_groups": True}))
    from transformers import AutoTokenizer
    env.renderer = ChatRenderer(AutoTokenizer.from_pretrained(settings["tokenizer"]))
    groups = load_groups(run_dir / "trajectories" / "arithmetic_tool.jsonl")[:limit]
    wanted = {g["item_id"] for g in groups}
    items: dict[str, Any] = {}
    while wanted - items.keys() and len(items) < 100_000:
        item = await env.get_next_item()
        items[item["id"]] = item
    turns: dict[tuple[int, ...], list] = {}
    n_turns = n_episodes = 0
    for group in groups:
        for t in group["trajectories"]:
            n_episodes += 1
            for start, end in t["turn_spans"]:
                n_turns += 1
                turns.setdefault(tuple(t["tokens"][:start]), []).append(
                    (t["tokens"][start:end], t["inference_logprobs"][start:end]))
    env.backend = VLLMBackend(ReplayPool(turns), env.renderer, env.config.sampling())
    started, cpu = time.monotonic(), time.process_time()
    for group in groups:
        await env.collect_group(items[group["item_id"]])
    cpu, wall = time.process_time() - cpu, time.monotonic() - started
    replayed = env.stats.assistant_turns
    if env.stats.groups_failed or replayed != n_turns:
        raise RuntimeError(f"the replay went astray: {replayed} of {n_turns} turns, "
                           f"{env.stats.groups_failed} groups failed ({env.last_error})")
    # the HTTP client's JSON per turn: the request it sends, an answer of the same size
    encode = decode = 0.0
    for context, recorded in list(turns.items())[:2000]:
        ids, logprobs = recorded[0] if recorded else ([], [])
        t0 = time.perf_counter()
        json.dumps({"model": "policy", "token_ids": list(context), "sampling_params": {
            "temperature": 1.0, "top_p": 1.0, "max_tokens": 48, "logprobs": 0, "n": 1}})
        t1 = time.perf_counter()
        json.loads(json.dumps({"choices": [{"token_ids": ids, "finish_reason": "stop",
                                            "logprobs": {"content": [
                                                {"token_id": i, "logprob": p}
                                                for i, p in zip(ids, logprobs)]}}]}))
        encode += t1 - t0
        decode += time.perf_counter() - t1
    n_json = min(len(turns), 2000)
    return {"groups": len(groups), "episodes": n_episodes, "turns": n_turns,
            "cpu_s": cpu, "wall_s": wall,
            "env_cpu_ms_per_turn": 1000 * cpu / n_turns,
            "env_cpu_ms_per_episode": 1000 * cpu / n_episodes,
            "json_encode_ms_per_turn": 1000 * encode / n_json,
            "json_roundtrip_answer_ms_per_turn": 1000 * decode / n_json}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a quickstart run directory (runs/quickstart)")
    parser.add_argument("--groups", type=int, default=64)
    args = parser.parse_args()
    result = asyncio.run(replay(Path(args.run_dir), args.groups))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
