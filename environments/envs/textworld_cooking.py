"""``textworld_cooking``: TextWorld's cooking games, made at set-up by TextWorld's own
generator (``textworld.challenges.tw_cooking``, the First TextWorld Problems' games).

The player must find the recipe's ingredients, prepare them as the recipe says (slice,
roast, ...), ``prepare meal`` and ``eat meal``; wrong moves can lose the game (burning an
ingredient, eating the wrong thing). One command per assistant turn, played through the
Gymnasium-style adapter (:mod:`environments.adapters.gym_env`; ``TextWorldGame``).

* **Games.** Each game is ``cooking.make`` with one seed (the game's ``options.seeds`` and
  its ``recipe_seed``) and the horizon's settings, compiled with Inform 7, and cached in
  ``cache_dir/<key>/`` (``key``: the settings and TextWorld's version) with a
  ``manifest.json`` that records every game's pool, seed, settings, SHA-256 (of the
  ``.z8`` and ``.json`` files, checked at every start), walkthrough and generation time,
  and the seeds of the last configuration's two pools.
  Generation runs with a fixed ``PYTHONHASHSEED`` (:data:`GENERATOR_HASH_SEED`), so a
  seed's files are byte-identical on every run. The training pool is the first ``train_games`` seeds from ``train_seed_base``, the
  held-out pool the first ``eval_items`` from ``eval_seed_base`` (seeds the generator
  fails on are recorded and skipped): disjoint ranges, checked. Games
  missing from the cache are generated at start, by ``generation_workers`` processes;
  several env processes starting at once share the work through a lock on the directory.
* **Horizon.** ``short``: recipe 1, one room, no preparation (walkthrough 5 commands,
  3 after the prompt's recipe and inventory); ``long``: recipe 1, six rooms, doors to
  open, cutting and cooking (walkthrough ~12). ``generator_settings`` overrides either.
* **Prompt.** The system prompt asks for one command a turn; the first observation holds
  the objective, the recipe, the room, the inventory and the admissible commands; each
  later one the game's feedback, the inventory and the admissible commands.
* **Scores.** A turn scores its increment of the game's score over the max score; the last
  turn's score is the outcome: 1 if the game was won, else 0. Step budget:
  ``budget_factor`` (2) times the walkthrough's length; running out ends the episode
  (not won).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from environments.adapters.gym_env import GymConfig, GymEnv, GymEpisode
from environments.adapters.textworld_game import TextWorldGame
from environments.framework.item_order import EpochOrder

log = logging.getLogger(__name__)

HORIZONS: dict[str, dict[str, Any]] = {
    "short": {"recipe": 1, "take": 1, "go": 1, "open": False, "cook": False, "cut": False,
              "drop": False},
    "long": {"recipe": 1, "take": 1, "go": 6, "open": True, "cook": True, "cut": True,
             "drop": False},
}
"""TextWorld's cooking settings (``tw-make tw-cooking --recipe ... --go ...``) per horizon."""

SYSTEM_PROMPT = ("You play a text game: cook the recipe's meal, then eat it. Each turn, "
                 "reply with one command, e.g. one of the admissible commands.")


GENERATOR_HASH_SEED = "0"
"""``PYTHONHASHSEED`` of the generator's processes: TextWorld's generator iterates over sets
of strings (the names a game's grammar excludes, the rules its Inform 7 source lists), so
with Python's per-process hash randomization one seed gives the same game written in
another order, and another SHA-256. With a fixed hash seed a seed's files are byte for byte
the same on every run."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("LACHESIS_TEXTWORLD_CACHE",
                               Path.home() / ".cache" / "lachesis" / "textworld_cooking"))


class TextWorldCookingConfig(GymConfig):
    """Settings of ``textworld_cooking``."""

    max_turns: int = Field(default=64, ge=1)
    """A cap on turns besides each game's step budget (which normally ends it first)."""
    max_token_length: int = Field(default=4096, ge=8)
    """Tokens per context at most (an observation is ~500 tokens of the tiny model's byte
    tokenizer, ~90 words)."""
    eval_items: int = Field(default=256, ge=1)
    """Held-out games (the eval pool), also what ``evaluate`` plays."""
    horizon: Literal["short", "long"] = "short"
    """``short``: walkthroughs of 5 commands; ``long``: 9-12 (:data:`HORIZONS`)."""
    generator_settings: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the horizon's settings (``recipe``, ``take``, ``go``, ``open``,
    ``cook``, ``cut``, ``drop``, ``split``)."""
    train_games: int = Field(default=256, ge=1)
    """Games in the training pool."""
    train_seed_base: int = Field(default=0, ge=0)
    """The training pool's first seed."""
    eval_seed_base: int = Field(default=1_000_000, ge=1)
    """The held-out pool's first seed."""
    cache_dir: Path = Field(default_factory=default_cache_dir)
    """Where the games and their manifest are kept (``$LACHESIS_TEXTWORLD_CACHE``)."""
    generation_workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    """Processes that generate missing games at start."""
    hidden_commands: list[str] = Field(default_factory=lambda: ["examine", "look",
                                                                "inventory"])
    """Admissible commands starting with one of these words are left out of the list
    shown (they change nothing, and the prompt shows the recipe and the inventory); the
    model may still type them."""
    budget_factor: float = Field(default=2.0, gt=0)
    """Step budget: this times the game's walkthrough length (rounded up)."""
    # the demonstrator (oracle_messages, for SFT warm starts; gym_demonstrator's settings)
    demonstrator_epsilon: float | None = Field(default=None, ge=0, le=1)
    """The noisy planner's ε: each of its commands is, with probability ε, one of the shown
    commands at random, else the game's planner's next command, re-planned from the
    current state (so the demonstrations show recoveries). None: calibrated to
    ``target_success`` when that is set, else 0."""
    # the adapter's settings, as this env plays
    action_pattern: str | None = r"^\s*([^\n]*)"
    """The command: the reply's first line."""
    system_prompt: str | None = SYSTEM_PROMPT
    """The system message: one command a turn."""
    success_info_key: str | None = "won"
    """Success is TextWorld's ``won``."""
    outcome: Literal["last_reward", "success"] = "success"
    """The last turn scores 1 if the game was won, else 0."""
    info_text_keys: list[str] = Field(default_factory=list)
    """None appended: the env formats its observations (feedback, inventory, commands)."""

    @model_validator(mode="after")
    def _pools_disjoint(self) -> TextWorldCookingConfig:
        train = range(self.train_seed_base, self.train_seed_base + self.train_games)
        held_out = range(self.eval_seed_base, self.eval_seed_base + self.eval_items)
        if train.start < held_out.stop and held_out.start < train.stop:
            raise ValueError(f"the training seeds {train.start}-{train.stop - 1} overlap the "
                             f"eval seeds {held_out.start}-{held_out.stop - 1}: move "
                             "train_seed_base or eval_seed_base")
        unknown = set(self.generator_settings) - {*HORIZONS["short"], "split"}
        if unknown:
            raise ValueError(f"generator_settings: unknown {sorted(unknown)}; TextWorld's "
                             f"cooking settings are {sorted({*HORIZONS['short'], 'split'})}")
        return self

    def game_settings(self) -> dict[str, Any]:
        return {**HORIZONS[self.horizon], "split": None, **self.generator_settings}


def file_sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def compact_recipe(text: str) -> str:
    """The cookbook's recipe on two lines: ``Ingredients: a, b`` and ``Directions: x; y``."""
    ingredients = re.search(r"Ingredients:\s*(.*?)\s*Directions:", text, re.S)
    directions = re.search(r"Directions:\s*(.*)", text, re.S)
    if not ingredients or not directions:
        return " ".join(text.split())
    lines = lambda part: [line.strip() for line in part.splitlines() if line.strip()]
    return (f"Ingredients: {', '.join(lines(ingredients.group(1)))}\n"
            f"Directions: {'; '.join(lines(directions.group(1)))}")


def generate_game(seed: int, settings: dict[str, Any], directory: str) -> dict[str, Any]:
    """One cooking game made by TextWorld's generator (in a worker process): its manifest
    entry."""
    import textworld
    from textworld.challenges.tw_cooking import cooking

    began = time.monotonic()
    options = textworld.GameOptions()
    options.seeds = seed
    options.path = str(Path(directory) / f"tw-cooking-{seed}.z8")
    options.force_recompile = True
    game = cooking.make({**settings, "recipe_seed": seed}, options)
    path = Path(textworld.generator.compile_game(game, options))
    seconds = time.monotonic() - began
    env = textworld.start(str(path), request_infos=textworld.EnvInfos(
        policy_commands=True, objective=True, extras=["recipe"]))
    state = env.reset()
    env.close()
    return {"seed": seed, "settings": {**settings, "recipe_seed": seed}, "file": path.name, "sha256": file_sha256(path, path.with_suffix(".json")),
            "walkthrough": list(game.walkthrough), "policy_steps": len(state["policy_commands"]),
            "max_score": game.max_score, "objective": state["objective"],
            "recipe": compact_recipe(state.get("extra.recipe") or ""),
            "generation_seconds": round(seconds, 3)}


def generate_games(seeds: list[int], settings: dict[str, Any], directory: Path,
                   workers: int) -> Iterator[dict[str, Any]]:
    """The manifest entries of ``seeds``' games, as ``workers`` subprocesses (``python -m
    environments.envs.textworld_cooking``, each a share of the seeds) make them. Plain
    subprocesses: multiprocessing's spawn would run the parent's main script again."""
    shares = [seeds[k::workers] for k in range(min(workers, len(seeds)))]
    errors = [tempfile.TemporaryFile("w+") for _ in shares]
    root = str(Path(__file__).resolve().parents[2])  # this checkout, first on the path
    processes = [subprocess.Popen(
        [sys.executable, "-m", "environments.envs.textworld_cooking",
         json.dumps({"seeds": share, "settings": settings, "directory": str(directory)})],
        stdout=subprocess.PIPE, stderr=error, text=True, cwd=root,
        env={**os.environ, "PYTHONHASHSEED": GENERATOR_HASH_SEED, "PYTHONPATH":
             os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))})
        for share, error in zip(shares, errors)]
    try:
        with selectors.DefaultSelector() as selector:
            for process in processes:
                selector.register(process.stdout, selectors.EVENT_READ)
            open_streams = len(processes)
            while open_streams:
                for key, _ in selector.select():
                    line = key.fileobj.readline()
                    if line:
                        yield json.loads(line)
                    else:
                        selector.unregister(key.fileobj)
                        open_streams -= 1
        for process, error in zip(processes, errors):
            if process.wait() != 0:
                error.seek(0)
                raise RuntimeError("textworld_cooking: generating games failed: "
                                   f"{error.read()[-2000:]}")
    finally:
        for process, error in zip(processes, errors):
            if process.poll() is None:
                process.kill()
                process.wait()
            error.close()


def _worker(job: dict[str, Any]) -> None:
    for seed in job["seeds"]:
        try:
            entry = generate_game(seed, job["settings"], job["directory"])
        except Exception as error:  # noqa: BLE001 - TextWorld's generator, for this seed
            entry = {"seed": seed, "failed": f"{type(error).__name__}: {error}"}
        print(json.dumps(entry), flush=True)



@contextlib.contextmanager
def _locked(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_games(config: TextWorldCookingConfig) -> tuple[Path, dict[str, Any]]:
    """The games both pools need, in the cache (generated when missing or changed): the
    game directory and its manifest (``pools``: each pool's seeds, in order).

    A pool is the first ``train_games`` (``eval_items``) seeds from its base for which the
    generator makes a game: for a few settings and seeds TextWorld's generator raises
    (e.g. an ingredient left with no preparation once ``cut`` removes the uncut ones);
    such a seed is recorded as failed and skipped."""
    import textworld

    settings = config.game_settings()
    key_source = json.dumps({"settings": settings, "textworld": textworld.__version__},
                            sort_keys=True)
    key = hashlib.sha256(key_source.encode()).hexdigest()[:12]
    directory = config.cache_dir / f"{config.horizon}-{key}"
    with _locked(directory):
        manifest_path = directory / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {
            "textworld": textworld.__version__, "settings": settings, "games": {},
            "failed": {}}
        games, failed = manifest["games"], manifest.setdefault("failed", {})
        for seed_key, entry in list(games.items()):  # a file changed or lost: made again
            path = directory / entry["file"]
            if not path.exists() or not path.with_suffix(".json").exists() or \
                    file_sha256(path, path.with_suffix(".json")) != entry["sha256"]:
                log.warning("textworld_cooking: game %s differs from its manifest entry; "
                            "it is made again when needed", path)
                del games[seed_key]
        pools = {"train": (config.train_seed_base, config.train_games),
                 "eval": (config.eval_seed_base, config.eval_items)}
        began = time.monotonic()
        while True:
            chosen = {name: pool_seeds(base, n, failed) for name, (base, n) in pools.items()}
            missing = [seed for seeds in chosen.values() for seed in seeds
                       if str(seed) not in games]
            if not missing:
                break
            log.info("textworld_cooking: generating %d games into %s (%d workers)",
                     len(missing), directory, config.generation_workers)
            for done, entry in enumerate(generate_games(missing, settings, directory,
                                                        config.generation_workers), 1):
                if "failed" in entry:
                    failed[str(entry["seed"])] = entry["failed"]
                else:
                    games[str(entry["seed"])] = entry
                if done % 16 == 0 or done == len(missing):
                    _write_json(manifest_path, manifest)
                    log.info("textworld_cooking: %d/%d games (%.0f s)", done, len(missing),
                             time.monotonic() - began)
        train, held_out = chosen["train"], chosen["eval"]
        if set(train) & set(held_out) or (min(train) < min(held_out) <= max(train)) or \
                (min(held_out) < min(train) <= max(held_out)):
            raise ValueError(f"textworld_cooking: with the seeds the generator skipped, the "
                             f"training seeds {min(train)}-{max(train)} reach the eval seeds "
                             f"{min(held_out)}-{max(held_out)}: move train_seed_base or "
                             "eval_seed_base apart")
        manifest["pools"] = chosen  # (this configuration's)
        _write_json(manifest_path, manifest)
    return directory, manifest


def pool_seeds(base: int, n: int, failed: dict[str, str]) -> list[int]:
    """The first ``n`` seeds from ``base`` that are not known to fail."""
    seeds, seed = [], base
    while len(seeds) < n:
        if str(seed) not in failed:
            seeds.append(seed)
        seed += 1
    return seeds


def _write_json(path: Path, value: Any) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(temporary, path)


class TextWorldCookingEnv(GymEnv):
    """TextWorld's cooking games, one command per turn (see the module docstring)."""

    name = "textworld_cooking"
    config_class = TextWorldCookingConfig

    def __init__(self, config: TextWorldCookingConfig | None = None):
        super().__init__(config)
        self.game_dir: Path | None = None
        self.manifest: dict[str, Any] = {}
        self.train_pool: list[dict[str, Any]] = []
        self.eval_pool: list[dict[str, Any]] = []
        self._order = EpochOrder(self.rng)

    def _item(self, entry: dict[str, Any]) -> dict[str, Any]:
        steps = len(entry["walkthrough"])
        return {"id": f"tw-{entry['seed']}", "seed": entry["seed"],
                "game": str(self.game_dir / entry["file"]), "walkthrough": entry["walkthrough"],
                "budget": max(1, math.ceil(steps * self.config.budget_factor)),
                "objective": entry["objective"], "recipe": entry["recipe"]}

    async def setup(self) -> None:
        config = self.config
        self.game_dir, self.manifest = await asyncio.to_thread(prepare_games, config)
        games = self.manifest["games"]
        pools = self.manifest["pools"]
        self.train_pool = [self._item(games[str(seed)]) for seed in pools["train"]]
        self.eval_pool = [self._item(games[str(seed)]) for seed in pools["eval"]]
        await super().setup()  # one game made and reset (network blocked), calibration

    async def get_next_item(self) -> dict[str, Any]:
        return self._order.next(self.train_pool)

    async def eval_items(self) -> list[dict[str, Any]]:
        return list(self.eval_pool)

    def make_env(self, item: dict[str, Any]) -> Any:
        return TextWorldGame(item["game"], max_steps=item["budget"], normalize_score=True)

    def make_episode(self, item: dict[str, Any]) -> GymEpisode:
        return GymEpisode(self.make_env(item), self.config, item["seed"], self.format)

    def format(self, episode: GymEpisode, text: str) -> str:
        """The feedback, then (while the game goes on) the inventory and the commands."""
        if episode.done:
            return text
        info, hidden = episode.info, tuple(self.config.hidden_commands)
        inventory = " ".join(str(info.get("inventory", "")).split())
        commands = [c for c in info.get("admissible_commands") or []
                    if c.split(" ", 1)[0] not in hidden]
        return f"{text}\n\nInventory: {inventory}\nCommands: {'; '.join(commands)}"

    def first_messages(self, item: dict[str, Any], observation: str) -> list[dict[str, Any]]:
        # the objective heads TextWorld's first feedback: shown once, with the recipe
        room = observation.removeprefix(item["objective"]).lstrip()
        return [{"role": "system", "content": self.config.system_prompt},
                {"role": "user", "content": f"{item['objective']}\n\nRecipe:\n{item['recipe']}"
                                            f"\n\n{room}"}]

    # -- the demonstrator: the game's planner, ε-noisy (gym_demonstrator) ---------------
    def shown_commands(self, info: dict[str, Any]) -> list[str]:
        hidden = tuple(self.config.hidden_commands)
        return [c for c in info.get("admissible_commands") or []
                if c.split(" ", 1)[0] not in hidden]

    def policy_action(self, observation: str, info: dict[str, Any],
                      history: list[dict[str, Any]]) -> str | None:
        """The planner's next command, re-planned from the current state; without a plan
        one of the shown commands (None: the noise's), or ``look`` when none is shown."""
        plan = info.get("policy_commands") or []
        return plan[0] if plan else None if self.shown_commands(info) else "look"

    def noise_action(self, observation: str, info: dict[str, Any],
                     history: list[dict[str, Any]], pick: float) -> str | None:
        """One of the shown commands."""
        shown = self.shown_commands(info)
        return shown[int(pick * len(shown))] if shown else None

    def demonstration_episode(self, item: dict[str, Any]) -> GymEpisode:
        env = TextWorldGame(item["game"], max_steps=item["budget"], normalize_score=True,
                            policy_commands=True)
        return GymEpisode(env, self.config, item["seed"], self.format)

    def rollout_metrics(self, item: Any, rollout: Any, scores: Any) -> dict[str, float]:
        return {**super().rollout_metrics(item, rollout, scores),
                "won": float(rollout.extra["success"]),
                "walkthrough_steps": float(len(item["walkthrough"]))}


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
