"""Gymnasium-style envs through Lachesis (``gym:SPEC``, environments/adapters/gym_env.py):
GEM's games (gem-llm 0.1.0), a gymnasium env and a TextWorld game made here by TextWorld's
own generator, all as shipped. Each turn's score must be what the env's own ``step``
returned for that turn's action, checked against a fresh copy of the env replayed outside
Lachesis.

The unit tests play scripted replies through the framework's real episode loop (tokens
from the tiny byte tokenizer, no inference server); the ``vllm`` test runs ``lachesis env
process`` against the session's tiny model on vLLM CPU and checks the sampled tokens with
``lachesis train --check``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, train_check

from environments.adapters.gym_env import GymEnvError, network_blocked
from environments.adapters.textworld_game import (
    TextWorldGame,
    clean_textworld_feedback,
    textworld_command,
)
from environments.framework.registry import EnvNotFoundError
from environments.inference.chat_template import ChatRenderer
from environments.jsonl_store import read_groups
from environments.rollout import GeneratedTurn
from lachesis.env_kinds import load_env_class

gem = pytest.importorskip("gem", reason="the gym extra (gem-llm) is not installed")
textworld = pytest.importorskip("textworld", reason="the gym extra (textworld) is not installed")

MASTERMIND = "game:Mastermind-v0-easy"
MINESWEEPER = "game:Minesweeper-v0-easy"
GUESS = "game:GuessTheNumber-v0-easy"


class Scripted:
    """A "model" whose reply at turn k is ``script(rollout, k)``. While it "generates",
    other code draws from the global random generators (as concurrent episodes and
    libraries do), and it yields to the event loop, so a group's episodes interleave."""

    trainable = True

    def __init__(self, renderer: ChatRenderer, script):
        self.renderer, self.script = renderer, script

    async def generate(self, state, max_tokens):
        await asyncio.sleep(0)
        random.random()
        np.random.random()
        text = self.script(state, len(state.turns))
        ids = self.renderer.encode(text)[:max(0, max_tokens - 1)]
        ids.append(self.renderer.tokenizer.eos_token_id)
        return GeneratedTurn(ids, [-0.5] * len(ids), text, "stop", True)


@pytest.fixture(scope="module")
def renderer():
    from lachesis.tiny_model import build_tokenizer

    return ChatRenderer(build_tokenizer())


def gym_env(name: str, renderer, script, **settings):
    cls = load_env_class(name)
    env = cls(cls.config_class(**{"keep_equal_score_groups": True, "max_token_length": 30000,
                                  **settings}))
    env.renderer = renderer
    env.backend = env.eval_backend = Scripted(renderer, script)
    asyncio.run(env.setup())
    return env


def group(env, item=None):
    async def collect():
        return await env.collect_group(item or await env.get_next_item())
    result = asyncio.run(collect())
    assert result is not None, env.last_error
    return result


def actions(trajectory) -> list[str]:
    return [m.content for m in trajectory.messages if m.role == "assistant"]


def observations(trajectory) -> list[str]:
    return [m.content for m in trajectory.messages if m.role in ("user", "tool")]


@pytest.fixture(scope="module")
def cooking_env_config(tmp_path_factory):
    """``textworld_cooking``'s settings with small pools (one training game, one held-out),
    in a cache of the module's."""
    return dict(horizon="short", train_games=1, eval_items=1, generation_workers=1,
                cache_dir=tmp_path_factory.mktemp("tw-cache"), group_size=1,
                keep_equal_score_groups=True, max_token_length=30000)


@pytest.fixture(scope="module")
def cooking_game(cooking_env_config):
    """A cooking game made by TextWorld's own generator (recipe 1, one room: through
    ``textworld_cooking``'s set-up, ``cooking.make`` and ``compile_game``), and its
    walkthrough."""
    from environments.envs.textworld_cooking import TextWorldCookingConfig, prepare_games

    directory, manifest = prepare_games(TextWorldCookingConfig(**cooking_env_config))
    entry = manifest["games"][str(manifest["pools"]["eval"][0])]
    return str(directory / entry["file"]), entry["walkthrough"]


# -- GEM ----------------------------------------------------------------------------------

def replay_gem(env_id: str, seed: int, moves: list[str]) -> list[tuple]:
    """The env played outside Lachesis: ``gem.make``, ``reset(seed)``, one step per move."""
    env = gem.make(env_id)
    first, _ = env.reset(seed=seed)
    return [first] + [env.step(move) for move in moves]


def test_a_gem_game_scores_each_turn_with_its_step_reward_and_ends_when_the_env_says(renderer):
    # turn 0 guesses two wrong digits, turn 1 two right ones in the wrong places, turn 2
    # the code: the script reads the code from a replay of the same seed, outside Lachesis
    seed = 7
    probe = gem.make(MASTERMIND)
    probe.reset(seed=seed)
    code = probe.game_code
    wrong = [d for d in range(1, 7) if d not in code][:2]
    moves = [f"I guess \\boxed{{{wrong[0]} {wrong[1]}}}", f"\\boxed{{{code[1]} {code[0]}}}",
             f"\\boxed{{{code[0]} {code[1]}}}"]
    env = gym_env(f"gym:gem/{MASTERMIND}", renderer, lambda state, k: moves[k],
                  group_size=3, max_turns=6)
    played = group(env, {"id": f"seed-{seed}", "seed": seed})
    replay = replay_gem(MASTERMIND, seed, moves)
    for t in played.trajectories:
        assert actions(t) == moves
        # the env's first observation, then each step's with GEM's suffix (info["suffix"])
        assert observations(t)[0] == replay[0].rstrip()
        assert observations(t)[1:] == [f"{r[0]}\n\n{r[4]['suffix']}" for r in replay[1:]]
        assert t.scores == [r[1] for r in replay[1:]] == [0.0, 0.0, 1.0]
        assert t.metadata["stop"] == "done" and not t.flags.truncated
        metrics = t.metadata["metrics"]
        assert metrics["success"] == 1.0 and metrics["steps"] == 3 and metrics["terminated"] == 1
    # a reply GEM cannot parse: GEM ends the episode with its format penalty
    env = gym_env(f"gym:gem/{MASTERMIND}", renderer, lambda state, k: "no idea", group_size=2)
    for t in group(env).trajectories:
        assert t.scores == [-0.1] and t.metadata["metrics"]["success"] == 0.0


def demonstrated(game: str) -> dict[str, str]:
    where = "environments.envs.gem_demonstrators"
    return {"demonstrator": f"{where}:{game}", "demonstrator_noise": f"{where}:{game}_noise"}


def test_gem_demonstrators_win_at_epsilon_0_and_their_actions_score_as_gem_scores_them(
        renderer):
    """Binary search on GEM's GuessTheNumber (1-10, 4 guesses) and the consistent-code
    solver on its Mastermind (6 guesses) win every one of 32 held-out games at epsilon 0
    (the solver's peg counts are GEM's, else it would rule out the code); a
    demonstration's actions, replied by a scripted model through the adapter, give its
    messages and GEM's own step rewards; the calibration lands in its band; a demonstrator
    that names nothing is refused."""
    demonstration: list[str] = []
    env = gym_env(f"gym:gem/{GUESS}", renderer, lambda state, k: demonstration[k],
                  group_size=1, eval_items=32, **demonstrated("guess_the_number"))
    items = env.calibration_items
    assert len(items) == 32 and env.demonstrator_success(0.0, items) == 1.0
    assert env.demonstrator_success(1.0, items) < 0.6  # uniform guesses
    mastermind = gym_env(f"gym:gem/{MASTERMIND}", renderer, lambda state, k: "",
                         make_kwargs={"max_turns": 6}, eval_items=32,
                         **demonstrated("mastermind"))
    assert mastermind.demonstrator_success(0.0, mastermind.calibration_items) == 1.0
    item = items[3]
    messages, won = env.demonstrate(item, 0.5, random.Random(2))
    demonstration += [m["content"] for m in messages if m["role"] == "assistant"]
    [t] = group(env, item).trajectories
    assert [m.model_dump(exclude_none=True) for m in t.messages] == messages
    replay = replay_gem(GUESS, item["seed"], demonstration)  # GEM outside Lachesis
    assert t.scores == [r[1] for r in replay[1:]]
    assert t.metadata["metrics"]["success"] == float(won)
    # the calibration: an epsilon whose demonstrator wins a share inside the band
    epsilon = env.calibrate(0.6, 0.8)
    assert 0 < epsilon < 1 and 0.6 <= env.demonstrator_success(epsilon, items) <= 0.8
    with pytest.raises(ValueError, match="demonstrator: cannot load 'nothing'"):
        load_env_class(f"gym:gem/{GUESS}").config_class(
            demonstrator="environments.envs.gem_demonstrators:nothing")


def test_the_gem_example_config_is_valid_and_a_warm_start_without_a_demonstrator_is_refused(
        tmp_path):
    import yaml

    from lachesis.run.config import RunConfig

    example = REPO / "configs" / "examples" / "gem-guess-the-number.yaml"
    RunConfig.load(example)  # every section validates
    config = yaml.safe_load(example.read_text())
    del config["warm_start"]["settings"]["demonstrator"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"warm_start.env: gym:gem/game:GuessTheNumber-v0-easy "
                                         r"cannot make demonstrations: it has no demonstrator"):
        RunConfig.load(tmp_path / "run.yaml")


def test_each_episode_keeps_its_own_random_stream_so_a_seed_is_one_game(renderer):
    """Minesweeper places its mines at the first reveal with Python's global `random`
    (seeded by GEM's reset): the group's episodes reveal concurrently while other code
    draws from `random`, and each still gets the board of its seed."""
    moves = ["\\boxed{reveal 2 2}", "\\boxed{reveal 0 0}", "\\boxed{reveal 4 4}",
             "\\boxed{reveal 0 4}", "\\boxed{flag 4 0}", "\\boxed{reveal 1 3}"]
    env = gym_env(f"gym:gem/{MINESWEEPER}", renderer, lambda state, k: moves[k],
                  group_size=4, max_turns=len(moves))
    for seed in (3, 11):
        played = group(env, {"id": f"seed-{seed}", "seed": seed})
        replay = replay_gem(MINESWEEPER, seed, moves)
        expected = [r[1] for r in replay[1:len(played.trajectories[0].scores) + 1]]
        for t in played.trajectories:
            assert t.scores == expected
            assert [o.split("\n\n")[0] for o in observations(t)[1:]] == \
                [r[0] for r in replay[1:len(t.scores) + 1]]
        assert any(s > 0 for s in expected)  # revealing scores: the boards are real


def test_a_game_that_downloads_at_run_time_fails_at_start_naming_the_download():
    cls = load_env_class("gym:gem/game:Wordle-v0-easy")
    env = cls(cls.config_class())
    with pytest.raises(GymEnvError, match=r"(?s)needs a download at run time.*"
                       r"raw\.githubusercontent\.com.*NLTK.*words"):
        asyncio.run(env.setup())
    # and the guard lets everything through again afterwards
    with network_blocked() as attempts:
        pass
    assert attempts == []
    import socket
    assert socket.getaddrinfo("127.0.0.1", 80)


# -- gymnasium -------------------------------------------------------------------------------

def test_a_discrete_gymnasium_env_takes_integers_as_text_or_tool_arguments(renderer):
    import gymnasium

    from sandbox_fixtures import tool_call

    script = {"text": ["north: 1", "9", "wait", "2"],
              "tool": [tool_call("act", action=1), tool_call("act", action=9),
                       tool_call("act", action="wait"), tool_call("act", action=2)]}
    for mode, replies in script.items():
        env = gym_env("gym:gymnasium/Taxi-v4", renderer, lambda state, k: replies[k],
                      group_size=2, max_turns=4, action_mode=mode,
                      make_kwargs={"render_mode": "ansi"})
        played = group(env, {"id": "seed-5", "seed": 5})
        direct = gymnasium.make("Taxi-v4", render_mode="ansi")
        direct.reset(seed=5)
        rewards = [direct.step(1)[1], direct.step(2)[1]]
        for t in played.trajectories:
            # the two out-of-range or non-integer actions are not stepped and score 0
            assert t.scores == [rewards[0], 0.0, 0.0, rewards[1]] == [-1.0, 0.0, 0.0, -1.0]
            assert t.metadata["metrics"]["invalid_actions"] == 2
            assert t.metadata["stop"] == "max_turns" and t.flags.truncated
            shown = observations(t)
            assert "\x1b[" not in shown[0] and "+---------+" in shown[0]
            assert "not between 0 and 5" in shown[2]
        if mode == "tool":
            assert "expected integer" in observations(played.trajectories[0])[3]


# -- TextWorld -------------------------------------------------------------------------------

def test_a_textworld_game_scores_its_score_increments_and_shows_admissible_commands(
        renderer, cooking_game):
    path, walkthrough = cooking_game
    env = gym_env(f"gym:textworld/{path}", renderer, lambda state, k: walkthrough[k],
                  group_size=2, max_turns=20, success_info_key="won",
                  make_kwargs={"normalize_score": True})
    direct = textworld.start(path, request_infos=textworld.EnvInfos(
        admissible_commands=True, max_score=True))
    state = direct.reset()
    expected, previous, admissible = [], 0, [state["admissible_commands"]]
    for command in walkthrough:
        state, score, done = direct.step(command)
        expected.append((score - previous) / state["max_score"])
        previous = score
        admissible.append(state["admissible_commands"])
    assert done and sum(expected) == pytest.approx(1.0)
    for t in group(env).trajectories:
        assert actions(t) == walkthrough
        assert t.scores == pytest.approx(expected)
        assert t.metadata["metrics"]["success"] == 1.0 and t.metadata["stop"] == "done"
        shown = observations(t)
        for text, commands in zip(shown[:-1], admissible):
            assert text.endswith("Admissible commands: " + "; ".join(commands))
        assert "Admissible commands" not in shown[-1] and "You scored" in shown[-1]
        assert "$$" not in shown[0] and "\n>" not in "".join(shown)  # banner, prompt gone
    # the outcome as success: 1 for the won game's last turn
    env = gym_env(f"gym:textworld/{path}", renderer, lambda state, k: walkthrough[k],
                  group_size=1, success_info_key="won", outcome="success",
                  make_kwargs={"normalize_score": True})
    [t] = group(env).trajectories
    assert t.scores == pytest.approx(expected[:-1] + [1.0])


def test_a_window_keeps_the_first_observation_and_the_last_turns_in_new_segments(
        renderer, cooking_game):
    path, walkthrough = cooking_game
    moves = ["look", "inventory", "examine cookbook", "look", "inventory", "look"]
    env = gym_env(f"gym:textworld/{path}", renderer, lambda state, k: moves[k],
                  group_size=1, max_turns=len(moves), history="window", window_turns=2)
    [t] = group(env).trajectories
    assert len(t.scores) == 6 and t.metadata["stop"] == "max_turns"
    # turns 0-2 in the first context (turn 2 sees the two before it), then each turn in a
    # segment of its own
    starts = t.segment_starts
    assert len(starts) == 3 and len(t.metadata["segments"]) == 4
    bounds = [0, *starts, len(t.tokens)]
    texts = [renderer.decode(t.tokens[a:b]) for a, b in zip(bounds, bounds[1:])]
    first_observation = observations(t)[0]
    assert texts[0].count("<|im_start|>assistant") == 3
    for k, text in enumerate(texts[1:], start=3):  # the segment where turn k is sampled
        assert text.startswith("<|im_start|>system") and first_observation in text
        assert text.count("<|im_start|>assistant") == 3  # two kept turns and turn k
        kept = moves[k - 2:k + 1]
        assert [s.split("<|im_end|>")[0].strip() for s in
                text.split("<|im_start|>assistant")[1:]] == kept
    # every trained token is a sampled one, in the segment it was sampled in
    for (a, b), move in zip(t.turn_spans, moves):
        assert renderer.decode(t.tokens[a:b]).startswith(move)
        assert not any(a < s < b for s in starts)
    # the full history: one context
    env = gym_env(f"gym:textworld/{path}", renderer, lambda state, k: moves[k],
                  group_size=1, max_turns=len(moves))
    [t] = group(env).trajectories
    assert t.segment_starts is None


def test_textworld_feedback_is_cleaned_of_the_interpreters_decorations(cooking_game,
                                                                        tmp_path):
    path, walkthrough = cooking_game
    game = TextWorldGame(path, max_steps=2)
    first, info = game.reset()
    assert first.startswith("You are hungry!") and info["max_score"] == 3
    assert info["inventory"] == "You are carrying nothing."
    observation, reward, terminated, truncated, _ = game.step("inventory")
    assert observation == "You are carrying nothing." and (reward, terminated, truncated) == \
        (0.0, False, False)
    _, _, terminated, truncated, _ = game.step("look")
    assert (terminated, truncated) == (False, True)  # the step budget
    game.close()
    # a random model's replies: the game gets a command it can read, never frotz's own
    # hotkeys (a backslash: frotz then waits for keys, and the env server hangs)
    assert textworld_command("\n é\\help\x1b  me\nlook") == "help me"
    assert textworld_command("take egg from fridge") == "take egg from fridge"
    replies = ["\\help", "\\x", "\x01\x7f😀 \n", "take egg from fridge\n\\q", "a" * 5000,
               "script", "save", "game"]  # (frotz's save and script write files)
    stepped = subprocess.run(
        [sys.executable, "-c", "import sys; from environments.adapters.textworld_game "
         "import TextWorldGame; game = TextWorldGame(sys.argv[1]); game.reset(); "
         "print([game.step(reply)[0][:30] for reply in sys.argv[2:]])", path, *replies],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert stepped.returncode == 0, stepped.stderr[-2000:]
    assert "look:" in stepped.stdout  # TextWorld's own help for "help"
    assert list(tmp_path.iterdir()) == []  # no saved game, no transcript
    assert clean_textworld_feedback("\nYou eat it.\n\n\n\n*** The End ***\n\nWould you like to "
                                    "RESTART, RESTORE?\n>  -= Kitchen =-3/4") == \
        "You eat it.\n\n*** The End ***"


# -- names --------------------------------------------------------------------------------

def test_gym_names_resolve_or_say_what_is_wrong(tmp_path):
    assert load_env_class(f"gym:gem/{MASTERMIND}").name == "gym-gem-game_Mastermind-v0-easy"
    assert load_env_class("gym:gymnasium/Taxi-v4").config_class().spec == "gymnasium/Taxi-v4"
    factory = load_env_class("gym:gymnasium:make")
    assert factory.name == "gym-gymnasium_make"
    for name, message in [("gym:", "needs a spec"), ("gym:gem/", "name the env after gem/"),
                          ("gym:nothing here", "use gym:gem/ID"),
                          (f"gym:textworld/{tmp_path}/none.z8", "no such game file")]:
        with pytest.raises(EnvNotFoundError, match=message):
            load_env_class(name)
    for name, message in [("gym:gem/game:Mastermind-v9", "GEM has no env 'game:Mastermind-v9'"),
                          ("gym:gymnasium/Taxi-v99", "gymnasium has no env 'Taxi-v99'"),
                          ("gym:no_such_module:make", "cannot load 'make' from 'no_such_module'")]:
        cls = load_env_class(name)
        with pytest.raises(GymEnvError, match=message):
            asyncio.run(cls(cls.config_class()).setup())


# -- through vLLM ----------------------------------------------------------------------------

def test_gym_envs_through_vllm_keep_the_exact_sampled_tokens(vllm_server, cooking_game,
                                                            tmp_path):
    """`lachesis env process gym:...` against the tiny model: a GEM game under a regex that
    makes the random model guess, and the TextWorld game unconstrained (its replies are
    noise the game answers with "I don't understand"); the turn scores are the envs' own
    replayed rewards, and the trainer's logprobs of the sampled tokens match vLLM's."""
    from transformers import AutoTokenizer

    path, _ = cooking_game
    end_of_turn = AutoTokenizer.from_pretrained(vllm_server.model_dir).convert_tokens_to_ids(
        "<|im_end|>")
    base = ["--tokenizer", str(vllm_server.model_dir), "--inference-servers", vllm_server.url,
            "--keep-equal-score-groups", "true", "--log-level", "WARNING"]
    gem_out, tw_out = tmp_path / "gem.jsonl", tmp_path / "tw.jsonl"
    for name, out, settings in [
            (f"gym:gem/{MASTERMIND}", gem_out,
             ["--max-turns", "4", "--max-tokens-per-turn", "16", "--group-size", "3",
              "--sampling-extra", json.dumps({"structured_outputs": {
                  "regex": r"\\boxed\{[1-6] [1-6]\}"}})]),
            (f"gym:textworld/{path}", tw_out,  # (a bias towards ending the turn early)
             ["--max-turns", "3", "--max-tokens-per-turn", "24", "--group-size", "3",
              "--max-token-length", "4000", "--sampling-extra", json.dumps(
                  {"logit_bias": {str(end_of_turn): 6}})])]:
        command = [sys.executable, "-m", "lachesis.cli", "env", "process", name, "--out",
                   str(out), "--groups", "2", *base, *settings]
        environ = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # (a crash says where)
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env=environ)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        assert summary["groups_sent"] == 2 and summary["groups_failed"] == 0, summary
    turns = 0
    for g in read_groups(gem_out):
        seed = int(g.item_id.removeprefix("seed-"))
        for t in g.trajectories:
            moves = actions(t)
            replay = replay_gem(MASTERMIND, seed, moves)
            assert t.scores == [r[1] for r in replay[1:]]
            assert (t.metadata["stop"] == "done") == replay[-1][2]
            turns += len(moves)
    assert turns > 6  # the guesses went on past the first turn
    tw_groups = list(read_groups(tw_out))
    assert max(len(t.turn_spans) for g in tw_groups for t in g.trajectories) >= 2
    assert all(set(t.scores) == {0.0} for g in tw_groups for t in g.trajectories)
    check = train_check(vllm_server.model_dir, tw_out, tmp_path / "check", batch_size=3)
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout)["alignment_mean_abs_diff"] < 1e-3


# -- textworld_cooking -------------------------------------------------------------------

def cooking_env(renderer, script, **settings):
    from environments.envs.textworld_cooking import TextWorldCookingConfig, TextWorldCookingEnv

    env = TextWorldCookingEnv(TextWorldCookingConfig(**settings))
    asyncio.run(env.setup())
    env.renderer = renderer
    env.backend = env.eval_backend = Scripted(renderer, script)
    return env


def test_cooking_games_are_generated_once_into_a_manifest_and_made_again_identically(
        cooking_env_config):
    from environments.envs.textworld_cooking import TextWorldCookingConfig, prepare_games

    config = TextWorldCookingConfig(**cooking_env_config)
    directory, manifest = prepare_games(config)
    assert manifest["pools"] == {"train": [0], "eval": [1_000_000]}
    entries = [manifest["games"][str(s)] for s in (0, 1_000_000)]
    for entry in entries:
        assert entry["settings"] == {**config.game_settings(), "recipe_seed": entry["seed"]}
        assert len(entry["sha256"]) == 64 and len(entry["walkthrough"]) == 5
        assert entry["generation_seconds"] > 0 and entry["max_score"] == 3
    assert len({e["sha256"] for e in entries}) == 2  # two different games
    # a second start finds them all: nothing is generated again
    game = directory / entries[1]["file"]
    stamp = game.stat().st_mtime_ns
    assert prepare_games(config)[1]["games"] == manifest["games"]
    assert game.stat().st_mtime_ns == stamp
    # a game that no longer matches its hash is made again, byte for byte the same
    game.write_bytes(b"not a game")
    again = prepare_games(config)[1]["games"][str(entries[1]["seed"])]
    assert again["sha256"] == entries[1]["sha256"] and game.stat().st_mtime_ns != stamp


def test_cooking_scores_increments_and_the_outcome_is_won_within_the_step_budget(
        renderer, cooking_env_config):
    plans = {}

    def play(state, k):
        return plans[state.messages[1]["content"]](k)

    env = cooking_env(renderer, play, **cooking_env_config)
    for item in env.eval_pool:
        first = env.first_messages(item, env.make_episode(item).reset())[1]["content"]
        plans[first] = lambda k, item=item: item["walkthrough"][k]
    item = env.eval_pool[0]
    [t] = group(env, item).trajectories
    # the walkthrough: score 1 of 3 for each of the last three commands, won
    assert actions(t) == item["walkthrough"]
    assert t.scores == pytest.approx([0.0, 0.0, 1 / 3, 1 / 3, 1.0])
    assert t.metadata["metrics"]["won"] == 1.0 and t.metadata["stop"] == "done"
    first = observations(t)[0]
    assert first.startswith(item["objective"]) and "\nRecipe:\nIngredients: " in first
    assert "\nInventory: You are carrying nothing.\nCommands: " in first
    shown = first.rsplit("Commands: ", 1)[1].split("; ")
    assert shown and not any(c.split()[0] in ("examine", "look", "inventory") for c in shown)
    # a policy that only looks around: its budget (twice the walkthrough) ends it, lost
    plans[env.first_messages(item, env.make_episode(item).reset())[1]["content"]] = \
        lambda k: "look"
    [t] = group(env, item).trajectories
    assert len(t.scores) == item["budget"] == 10 and set(t.scores) == {0.0}
    assert t.metadata["metrics"]["env_truncated"] == 1.0 and not t.flags.truncated


def test_cooking_settings_that_cannot_work_are_refused(cooking_env_config):
    from environments.envs.textworld_cooking import TextWorldCookingConfig

    with pytest.raises(ValueError, match="overlap the eval seeds"):
        TextWorldCookingConfig(train_games=10, train_seed_base=0, eval_seed_base=5)
    with pytest.raises(ValueError, match=r"unknown \['rooms'\]"):
        TextWorldCookingConfig(generator_settings={"rooms": 3})
    assert load_env_class("textworld_cooking").config_class().eval_items == 256


def test_the_noisy_planner_demonstrates_in_the_envs_format_and_calibrates_epsilon(
        renderer, cooking_env_config):
    env = cooking_env(renderer, lambda state, k: "look", **cooking_env_config)
    item = env.eval_pool[0]
    # epsilon 0: the planner's commands from the start win, in the env's own messages
    messages, won = env.demonstrate(item, 0.0, random.Random(0))
    [t] = group(env, item).trajectories
    assert won and messages[:2] == [m.model_dump(exclude_none=True) for m in t.messages[:2]]
    commands = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(commands) == 3 and commands[-2:] == ["prepare meal", "eat meal"]
    # epsilon 1: random shown commands until the budget or a fatal move ends the game
    messages, won = env.demonstrate(item, 1.0, random.Random(0))
    assert not won and 1 <= len([m for m in messages if m["role"] == "assistant"]) <= 10
    # a band the planner reaches: epsilon 0; one held-out game cannot land in (0.4, 0.6)
    assert env.calibrate(0.9, 1.0) == 0.0
    env.calibration.clear()
    with pytest.raises(ValueError, match=r"no epsilon found in 12 bisection steps on 1 "
                                         r"held-out games \(epsilon: success 0.0000: 1.000"):
        env.calibrate(0.4, 0.6)
    # each draw of an item is a new demonstration
    env.epsilon = 0.5
    draws = [env.oracle_messages(item) for _ in range(4)]
    assert len({json.dumps(d) for d in draws}) > 1
    # what lachesis run keeps beside the demonstrations: the epsilon and the tries
    summary = env.demonstrator_summary()
    assert summary["epsilon"] == 0.5 and summary["calibration"][0] == {"epsilon": 0.0,
                                                                       "success": 1.0}


def test_an_env_tokenizer_learns_on_its_demonstrations_and_shortens_the_observations(
        tmp_path, cooking_env_config):
    """``make-tiny-model --tokenizer env --env textworld_cooking``: BPE merges learned on
    the noisy planner's games of the training pool. A held-out game's observations encode
    in under a third of their bytes and decode to themselves; the model's vocabulary is
    the tokenizer's; an env without demonstrations is refused, naming it."""
    from transformers import AutoConfig, AutoTokenizer

    from environments.envs.textworld_cooking import TextWorldCookingConfig, TextWorldCookingEnv
    from lachesis.tiny_model import make_tiny_model

    settings = {k: cooking_env_config[k] for k in ("horizon", "train_games", "eval_items",
                                                   "generation_workers", "cache_dir")}
    out = make_tiny_model(tmp_path / "m", tokenizer="env", env="textworld_cooking",
                          env_settings={**settings, "demonstrator_epsilon": 0.5},
                          corpus_conversations=16, vocab_size=600, hidden_size=64,
                          num_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert AutoConfig.from_pretrained(out).vocab_size == len(tokenizer) > 300
    env = TextWorldCookingEnv(TextWorldCookingConfig(**settings))
    asyncio.run(env.setup())
    messages, _ = env.demonstrate(env.eval_pool[0], 0.5, random.Random(1))
    texts = [m["content"] for m in messages if m["role"] == "user"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert sum(len(tokenizer.encode(t)) for t in texts) < sum(map(len, texts)) / 3
    assert tokenizer.apply_chat_template(messages[:2], tokenize=False).startswith(
        "<|im_start|>system\nYou play a text game")
    with pytest.raises(ValueError, match="tokenizer .env. needs the env"):
        make_tiny_model(tmp_path / "n", tokenizer="env")
