"""What ``textworld_cooking``'s games cost and how long they are, per horizon.

    python benchmarks/textworld_games.py --games 16 --cache /tmp/tw-bench [--workers 2]

For each horizon: generates ``--games`` held-out games (seeds from the env's eval base)
into ``--cache`` with the env's own set-up (TextWorld's generator, ``--workers``
processes), then plays each game's walkthrough through the env's episode loop (a scripted
policy, no model) and prints, as JSON: generation seconds per game (TextWorld's make and
compile, from the manifest) and the set-up's wall time, walkthrough and planner steps, the
step budget, seconds per env step, the size of each observation message (characters,
words, and tokens of the tiny model's byte tokenizer), and the share of the games the
epsilon-noisy planner demonstrator wins at each ``--epsilons``. With ``--tokenizer`` (a
model directory, e.g. the one ``configs/textworld.yaml`` builds with a tokenizer learned on
game text), also each observation's and each walkthrough conversation's tokens in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from environments.envs.textworld_cooking import (  # noqa: E402
    TextWorldCookingConfig,
    TextWorldCookingEnv,
)
from environments.inference.chat_template import ChatRenderer  # noqa: E402
from environments.rollout import GeneratedTurn  # noqa: E402


class Walkthrough:
    trainable = True

    def __init__(self, renderer, plans):
        self.renderer, self.plans = renderer, plans

    async def generate(self, state, max_tokens):
        text = self.plans[state.messages[1]["content"]][len(state.turns)]
        ids = self.renderer.encode(text) + [self.renderer.tokenizer.eos_token_id]
        return GeneratedTurn(ids, [0.0] * len(ids), text, "stop", True)


def spread(values):
    return {"mean": round(statistics.mean(values), 2), "min": min(values), "max": max(values)}


async def measure(horizon: str, games: int, cache: Path, workers: int,
                  epsilons: list[float], tokenizer: str | None = None,
                  settings: dict | None = None) -> dict:
    from lachesis.tiny_model import build_tokenizer

    config = TextWorldCookingConfig(horizon=horizon, train_games=1, eval_items=games,
                                    cache_dir=cache, generation_workers=workers,
                                    group_size=1, max_token_length=10**6,
                                    keep_equal_score_groups=True, **(settings or {}))
    env = TextWorldCookingEnv(config)
    renderer = ChatRenderer(build_tokenizer())
    began = time.monotonic()
    await env.setup()
    setup_seconds = time.monotonic() - began
    entries = [env.manifest["games"][str(s)] for s in env.manifest["pools"]["eval"]]
    plans = {}
    for item in env.eval_pool:
        first = env.first_messages(item, env.make_episode(item).reset())[1]["content"]
        plans[first] = item["walkthrough"]
    env.renderer = renderer
    env.backend = env.eval_backend = Walkthrough(renderer, plans)
    learned = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        learned = ChatRenderer(AutoTokenizer.from_pretrained(tokenizer))
    won, chars, words, tokens, step_seconds = [], [], [], [], []
    learned_tokens, conversation_tokens = [], []
    for item in env.eval_pool:
        began = time.monotonic()
        [trajectory] = (await env.collect_group(item)).trajectories
        step_seconds.append((time.monotonic() - began) / len(trajectory.turn_spans))
        won.append(trajectory.metadata["metrics"]["won"])
        for message in trajectory.messages[1:]:
            if message.role == "user":
                chars.append(len(message.content))
                words.append(len(message.content.split()))
                tokens.append(len(renderer.encode(message.content)))
                if learned is not None:
                    learned_tokens.append(len(learned.encode(message.content)))
        if learned is not None:
            conversation_tokens.append(len(learned.encode(learned.render(
                [m.model_dump(exclude_none=True) for m in trajectory.messages]))))
    demonstrator = {}
    for epsilon in epsilons:
        began = time.monotonic()
        demonstrator[str(epsilon)] = {
            "won": env.demonstrator_success(epsilon, env.eval_pool),
            "seconds_per_game": round((time.monotonic() - began) / len(env.eval_pool), 3)}
    return {"horizon": horizon, "settings": config.game_settings(), "games": len(entries),
            "failed_seeds": len(env.manifest.get("failed", {})),
            "setup_wall_seconds": round(setup_seconds, 1),
            "generation_seconds_per_game": spread([e["generation_seconds"] for e in entries]),
            "walkthrough_steps": spread([len(e["walkthrough"]) for e in entries]),
            "planner_steps_from_the_start": spread([e["policy_steps"] for e in entries]),
            "max_score": spread([e["max_score"] for e in entries]),
            "step_budget": spread([i["budget"] for i in env.eval_pool]),
            "walkthrough_won": sum(won) / len(won),
            "seconds_per_step": round(statistics.mean(step_seconds), 4),
            "observation_chars": spread(chars), "observation_words": spread(words),
            "observation_byte_tokens": spread(tokens),
            "demonstrator_won_by_epsilon": demonstrator,
            **({"tokenizer": tokenizer, "vocabulary": len(learned.tokenizer),
                "observation_tokens": spread(learned_tokens),
                "walkthrough_conversation_tokens": spread(conversation_tokens)}
               if learned is not None else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--games", type=int, default=16)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--horizons", nargs="+", default=["short", "long"])
    parser.add_argument("--epsilons", nargs="*", type=float,
                        default=[0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0],
                        help="the noisy planner's epsilons to measure its success at")
    parser.add_argument("--settings", type=yaml.safe_load, default=None,
                        help="env settings, e.g. '{hidden_commands: [examine, look]}'")
    parser.add_argument("--tokenizer", help="a model directory: also count tokens in its "
                                            "tokenizer")
    args = parser.parse_args()
    for horizon in args.horizons:
        print(json.dumps(asyncio.run(measure(horizon, args.games, args.cache, args.workers,
                                             args.epsilons, args.tokenizer,
                                             args.settings))), flush=True)


if __name__ == "__main__":
    main()
