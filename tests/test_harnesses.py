"""The harness catalog without the harnesses: each entry's launch (command line, env,
config files), the env's launch of a harness (mounts, seeded HOME, nothing of ours in the
agent's environment), the memory rule, the cache's install lock and atomicity (a fake
registry command), the launcher's HOME seeding, and the agent-failure messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO

from environments import BaseEnv
from environments.blackbox import BlackBoxEnvConfig, BlackBoxEnvMixin
from environments.blackbox.agents.runtime import MOUNT
from environments.blackbox.env import AgentError
from environments.blackbox.harness_cache import cache_root, install, install_commands, installed
from environments.blackbox.harnesses import (
    HARNESS_MOUNT,
    HARNESSES,
    HOME_SEED,
    MARKER,
    SANDBOX_HOME,
    HarnessError,
    RolloutSpec,
    node_package,
)
from environments.sandbox import ExecResult

SPEC = RolloutSpec(base_url="http://127.0.0.1:8765/rollout/abc/v1", token="tok-123",
                   model="tiny", task="Fix the bug in main.py", context_window=8192,
                   max_output_tokens=256)
LAUNCHER = REPO / "environments" / "blackbox" / "agents" / "launch.py"


def test_every_harness_is_pinned_and_points_at_the_proxy_with_nothing_of_ours():
    assert set(HARNESSES) == {"pi", "codex", "claude-code", "opencode", "mini-swe-agent",
                              "openai-agents", "gemini-cli", "hermes", "qwen-code",
                              "kimi-code", "kilo", "openclaw", "aider"}
    for harness in HARNESSES.values():
        assert harness.version[0].isdigit() and harness.min_memory_mb <= harness.memory_mb
        launch = harness.launch(SPEC)
        assert launch.argv[0] == f"{HARNESS_MOUNT}/{harness.entry}"
        assert not {"PYTHONPATH", "PYTHONHOME", "HOME"} & set(launch.env), harness.name
        assert not [k for k in launch.env if k.startswith("LACHESIS_") and k != "LACHESIS_TASK"]
        everything = json.dumps([launch.argv, launch.env, launch.files, launch.stdin])
        assert SPEC.task in everything  # the task reaches it (argv, env or stdin)
        if harness.node:  # a newer Node from npm, installed with it, runs its script
            assert install_commands(harness, Path("/x"))[0][-1] == \
                f"{node_package()}@{harness.node}"
            assert harness.entry == f"node_modules/{node_package()}/bin/node"
            assert launch.argv[1].startswith(f"{HARNESS_MOUNT}/node_modules/")
        if harness.wire_api == "messages":
            assert launch.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8765/rollout/abc"
            assert launch.env["ANTHROPIC_API_KEY"] == SPEC.token
        elif harness.wire_api == "gemini":
            assert launch.env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:8765/rollout/abc"
            assert launch.env["GEMINI_API_KEY"] == SPEC.token
        else:  # (Hermes: in its config.yaml)
            assert SPEC.base_url in everything and SPEC.token in everything


def test_pi_has_its_provider_entry_and_no_compaction_nor_retries():
    launch = HARNESSES["pi"].launch(SPEC)
    models = json.loads(launch.files[".pi/agent/models.json"])
    provider = models["providers"]["lachesis"]
    assert provider["baseUrl"] == SPEC.base_url and provider["api"] == "openai-completions"
    assert launch.env[provider["apiKey"]] == SPEC.token  # Pi reads the key from the variable
    assert provider["models"] == [{"id": "tiny", "contextWindow": 8192, "maxTokens": 256}]
    settings = json.loads(launch.files[".pi/agent/settings.json"])
    assert settings["compaction"] == {"enabled": False}
    assert settings["retry"]["enabled"] is False
    assert launch.env["PI_OFFLINE"] == "1"
    assert launch.env["NODE_OPTIONS"] == "--disable-wasm-trap-handler"
    assert launch.argv[1:] == ["-p", "--no-session", "--provider", "lachesis", "--model",
                               "tiny", SPEC.task]


def test_opencode_gets_its_task_on_stdin_and_no_title_agent():
    launch = HARNESSES["opencode"].launch(SPEC)
    config = json.loads(launch.env["OPENCODE_CONFIG_CONTENT"])
    assert config["agent"]["title"]["disable"] is True
    assert config["model"] == "lachesis/tiny"
    provider = config["provider"]["lachesis"]
    assert provider["options"]["baseURL"] == SPEC.base_url
    assert provider["models"]["tiny"]["limit"] == {"context": 8192, "output": 256}
    assert launch.stdin == SPEC.task and SPEC.task not in launch.argv
    assert launch.env["OPENCODE_DISABLE_AUTOCOMPACT"] == "1"


def test_codex_speaks_responses_and_is_told_of_a_window_it_never_compacts_in():
    launch = HARNESSES["codex"].launch(SPEC)
    config = tomllib.loads(launch.files[".codex/config.toml"])
    provider = config["model_providers"][config["model_provider"]]
    assert provider["wire_api"] == "responses" and provider["base_url"] == SPEC.base_url
    assert launch.env[provider["env_key"]] == SPEC.token
    assert provider["request_max_retries"] == provider["stream_max_retries"] == 0
    assert config["model_context_window"] >= 10**9 and config["web_search"] == "disabled"
    assert config["approval_policy"] == "never"
    assert launch.env["CODEX_HOME"] == f"{SANDBOX_HOME}/.codex"
    assert "--dangerously-bypass-approvals-and-sandbox" in launch.argv
    assert launch.argv[-2:] == ["--", SPEC.task]
    if launch.argv[0].endswith("/vendor/x86_64-unknown-linux-musl/bin/codex"):  # no Node
        assert launch.env["CODEX_MANAGED_PACKAGE_ROOT"] == \
            f"{HARNESS_MOUNT}/node_modules/@openai/codex"


def test_claude_code_uses_the_rollout_model_everywhere_and_sends_no_extra_traffic():
    env = HARNESSES["claude-code"].launch(SPEC).env
    for key in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert env[key] == "tiny"
    for key in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_AUTO_COMPACT",
                "DISABLE_TELEMETRY"):
        assert env[key] == "1"
    assert env["CLAUDE_CODE_MAX_RETRIES"] == "0" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "256"


def test_gemini_cli_runs_headless_with_its_auth_preset_and_no_extra_model_calls():
    launch = HARNESSES["gemini-cli"].launch(SPEC)
    assert launch.argv[1:] == ["--yolo", "--model=tiny", f"--prompt={SPEC.task}"]
    settings = json.loads(launch.files[".gemini/settings.json"])
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["model"]["compressionThreshold"] == 1.0
    assert settings["model"]["disableLoopDetection"] is True
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["general"]["enableAutoUpdate"] is False
    assert launch.env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"


def test_hermes_has_its_provider_in_config_yaml_and_no_extra_model_calls():
    launch = HARNESSES["hermes"].launch(SPEC)
    config = json.loads(launch.files[".hermes/config.yaml"])  # (JSON is YAML)
    provider = config["providers"][config["model"]["provider"]]
    assert provider == {"api": SPEC.base_url, "api_key": SPEC.token,
                        "transport": "${HERMES_API_MODE}", "discover_models": False}
    assert launch.env["HERMES_API_MODE"] == "chat_completions"
    assert config["model"]["context_length"] == 64000  # (no /models probe; its minimum)
    assert config["compression"]["enabled"] is False
    assert config["auxiliary"]["title_generation"]["enabled"] is False
    assert config["approvals"]["mode"] == "off"
    assert config["memory"]["memory_enabled"] is False
    assert config["skills"]["creation_nudge_interval"] == 0
    assert launch.env["HERMES_HOME"] == f"{SANDBOX_HOME}/.hermes"
    assert launch.argv[1:] == ["-m", "hermes_cli.main", "-z", SPEC.task]


def test_openclaw_installs_without_npm_scripts_then_runs_its_postinstall_on_its_own_node():
    """OpenClaw's preinstall refuses the host's Node 20: npm runs no install scripts, then
    its postinstall runs on the Node 24 installed with it (the install is read-only in
    the sandbox, where it could not finish it)."""
    harness = HARNESSES["openclaw"]
    npm, postinstall = install_commands(harness, Path("/x"))
    assert npm[:2] == ["npm", "install"] and "--ignore-scripts" in npm
    assert npm[-2:] == ["openclaw@2026.9.6", f"{node_package()}@24.22.3"]
    assert postinstall == [f"/x/node_modules/{node_package()}/bin/node",
                           "/x/node_modules/openclaw/scripts/postinstall-bundled-plugins.mjs"]
    launch = harness.launch(SPEC)
    assert launch.argv[2:5] == ["agent", "exec", "--config"]
    config = json.loads(launch.files[".openclaw/lachesis.json"])
    assert config["models"]["providers"]["lachesis"]["baseUrl"] == SPEC.base_url
    assert config["agents"]["defaults"]["compaction"] == {"enabled": False,
                                                          "memoryFlush": {"enabled": False}}


def test_aider_gets_its_model_window_from_a_file_and_no_tool_calls_are_scripted():
    from environments.envs.answer_file import script_for

    launch = HARNESSES["aider"].launch(SPEC)
    assert launch.argv[1:3] == ["-m", "aider"] and launch.argv[-2:] == ["--message", SPEC.task]
    metadata = json.loads(launch.files[".aider.model.metadata.json"])
    assert metadata["openai/tiny"]["max_input_tokens"] == SPEC.context_window
    assert launch.env["OPENAI_API_BASE"] == SPEC.base_url
    assert script_for("aider", 7) == ["answer.txt\n```\n7\n```"]
    assert len(script_for("kilo", 7)) == 2  # a tool call, then the answer


def test_harness_compaction_stays_off_unless_asked_for_then_is_sized_to_the_window():
    import dataclasses

    def compaction(spec):
        launch = {name: h.launch(spec) for name, h in HARNESSES.items()}
        return {
            "pi": json.loads(launch["pi"].files[".pi/agent/settings.json"])["compaction"][
                "enabled"],
            "opencode": "OPENCODE_DISABLE_AUTOCOMPACT" not in launch["opencode"].env,
            "codex": tomllib.loads(launch["codex"].files[".codex/config.toml"])[
                "model_context_window"],
            "claude-code": "DISABLE_AUTO_COMPACT" not in launch["claude-code"].env,
            "gemini-cli": json.loads(launch["gemini-cli"].files[".gemini/settings.json"])[
                "model"]["compressionThreshold"] * 1048576,
            "hermes": json.loads(launch["hermes"].files[".hermes/config.yaml"])[
                "compression"]["enabled"],
            "qwen-code": json.loads(launch["qwen-code"].files[".qwen/settings.json"])[
                "model"]["generationConfig"]["contextWindowSize"],
            "kimi-code": int(launch["kimi-code"].env["KIMI_MODEL_MAX_CONTEXT_SIZE"]),
            "kilo": "KILO_DISABLE_AUTOCOMPACT" not in launch["kilo"].env,
            "openclaw": json.loads(launch["openclaw"].files[".openclaw/lachesis.json"])[
                "agents"]["defaults"]["compaction"]["enabled"]}

    assert compaction(SPEC) == {"pi": False, "opencode": False, "codex": 10**9,
                                "claude-code": False, "gemini-cli": 1048576, "hermes": False,
                                "qwen-code": 10**9, "kimi-code": 10**9, "kilo": False,
                                "openclaw": False}
    assert compaction(dataclasses.replace(SPEC, compaction=True)) == {
        "pi": True, "opencode": True, "codex": 8192, "claude-code": True,
        "gemini-cli": 4096, "hermes": True, "qwen-code": 8192, "kimi-code": 8192,
        "kilo": True, "openclaw": True}


def test_the_python_harnesses_run_their_own_python_without_our_packages():
    mini = HARNESSES["mini-swe-agent"].launch(SPEC)
    assert mini.argv[:3] == [f"{HARNESS_MOUNT}/bin/python", "-m", "minisweagent.run.mini"]
    assert mini.env["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] == "1"
    assert mini.argv[mini.argv.index("--model") + 1] == "openai/tiny"
    agents = HARNESSES["openai-agents"].launch(SPEC)
    assert agents.argv == [f"{HARNESS_MOUNT}/bin/python", f"{MOUNT}/openai_agents_agent.py"]
    assert agents.env["OPENAI_AGENTS_API"] == "responses" and agents.env["AGENT_STREAM"] == "1"
    assert (REPO / "environments/blackbox/agents/openai_agents_agent.py").is_file()
    assert install_commands(HARNESSES["mini-swe-agent"], Path("/x"))[0][:3] == [
        "/usr/bin/python3", "-m", "venv"]


def test_a_harness_raises_the_memory_and_context_defaults_and_refuses_less_memory():
    assert BlackBoxEnvConfig().sandbox_memory_mb == 2048
    # and the context: harnesses' first prompts run to ~20k tokens with a real tokenizer
    assert BlackBoxEnvConfig().max_token_length == 4096
    assert BlackBoxEnvConfig(agent="claude-code").max_token_length == 32768
    assert BlackBoxEnvConfig(agent="pi", max_token_length=8000).max_token_length == 8000
    assert BlackBoxEnvConfig(agent="opencode").sandbox_memory_mb == HARNESSES["opencode"].memory_mb
    assert BlackBoxEnvConfig(agent="codex", sandbox_memory_mb=1500).sandbox_memory_mb == 1500
    with pytest.raises(ValueError, match="agent: claude-code needs sandbox_memory_mb of 3072"):
        BlackBoxEnvConfig(agent="claude-code", sandbox_memory_mb=2048)
    with pytest.raises(ValueError):
        BlackBoxEnvConfig(agent="goose")


class HarnessEnv(BlackBoxEnvMixin, BaseEnv):
    name = "harness_test"
    config_class = BlackBoxEnvConfig

    async def get_next_item(self):
        return {"id": "x"}

    def agent_task(self, item):
        return "Say hi."


def prepared_env(tmp_path: Path, agent: str, **settings) -> HarnessEnv:
    """The env's launch state as ``start`` leaves it, without vLLM or an install."""
    env = HarnessEnv(BlackBoxEnvConfig(agent=agent, agent_env={"EXTRA": "1"}, **settings))
    env.proxy = SimpleNamespace(
        model_name="policy",
        base_url=lambda rollout, server=None: f"{server or 'http://127.0.0.1:9'}/rollout/"
                                              f"{rollout.id}/v1")
    env._runtime, env._socket_dir = tmp_path / "runtime", tmp_path / "sockets"
    env._harness, env._harness_dir = HARNESSES[agent], tmp_path / "install"
    return env


def test_the_env_mounts_the_install_and_the_seeded_home_and_sets_only_the_harness_env(
        tmp_path):
    env = prepared_env(tmp_path, "opencode", max_token_length=3000)
    rollout = SimpleNamespace(id="r1", token="t1")
    home = tmp_path / "home"
    home.mkdir()
    command, environment, mounts = env._agent_launch({"id": "x"}, rollout, home)

    assert mounts == {str(tmp_path / "runtime"): MOUNT, str(tmp_path / "sockets"): "/run/lachesis",
                      str(tmp_path / "install"): HARNESS_MOUNT, str(home): HOME_SEED}
    dash = command.index("--")
    assert command[:2] == ["python3", f"{MOUNT}/launch.py"]
    assert command[dash - 4:dash] == ["--home", f"{HOME_SEED}/home", "--stdin",
                                      f"{HOME_SEED}/stdin"]
    assert command[dash + 1] == f"{HARNESS_MOUNT}/node_modules/.bin/opencode"
    assert (home / "stdin").read_text() == "Say hi."
    assert environment["HOME"] == SANDBOX_HOME and environment["EXTRA"] == "1"
    assert "PYTHONPATH" not in environment and "LACHESIS_TASK" not in environment
    config = json.loads(environment["OPENCODE_CONFIG_CONTENT"])
    assert config["provider"]["lachesis"]["options"]["baseURL"] == \
        "http://127.0.0.1:8765/rollout/r1/v1"
    assert config["provider"]["lachesis"]["models"]["policy"]["limit"]["context"] == 3000

    env = prepared_env(tmp_path, "pi")
    command, environment, _ = env._agent_launch({"id": "x"}, rollout, home)
    assert json.loads((home / "home/.pi/agent/settings.json").read_text())["compaction"] == {
        "enabled": False}
    assert oct((home / "home/.pi/agent").stat().st_mode & 0o777) == "0o755"


def test_unsafe_subprocess_runs_the_harness_from_host_paths(tmp_path):
    env = prepared_env(tmp_path, "codex", sandbox_backend="unsafe_subprocess",
                       sandbox_allow_unsafe=True)
    home = tmp_path / "home"
    home.mkdir()
    command, environment, mounts = env._agent_launch({"id": "x"}, SimpleNamespace(
        id="r2", token="t2"), home)
    assert mounts == {}
    assert command[:2] == ["python3", str(tmp_path / "runtime" / "launch.py")]
    assert "--listen" not in command
    assert command[command.index("--") + 1] == str(tmp_path / "install" /
                                                   HARNESSES["codex"].entry)
    assert environment["HOME"] == str(home / "run-home")
    assert environment["CODEX_HOME"] == str(home / "run-home" / ".codex")
    assert "base_url = \"http://127.0.0.1:9/rollout/r2/v1\"" in \
        (home / "home/.codex/config.toml").read_text()


def test_an_agent_command_override_and_a_harness_are_refused_together():
    class Both(HarnessEnv):
        def agent_command(self, item):
            return ["python3", "mine.py"]

    env = Both(BlackBoxEnvConfig(agent="pi"))
    with pytest.raises(ValueError, match="overrides agent_command and its config names agent: pi"):
        import asyncio

        asyncio.run(env._install_harness())


# -- the cache -------------------------------------------------------------------------------
class FakeRegistry:
    """Stands in for npm / pip: makes the entry program, counts its runs."""

    def __init__(self, harness, delay_s: float = 0.0, fail: bool = False, entry: bool = True):
        self.harness, self.delay_s, self.fail, self.entry = harness, delay_s, fail, entry
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, command, **kwargs):
        with self.lock:
            self.calls.append(command)
        time.sleep(self.delay_s)
        if self.fail:
            return subprocess.CompletedProcess(command, 1, "", "npm error 404 Not Found")
        target = Path(command[command.index("--prefix") + 1])
        if self.entry:
            program = target / self.harness.entry
            program.parent.mkdir(parents=True, exist_ok=True)
            program.write_text("#!/bin/sh\n")
            program.chmod(0o700)
        return subprocess.CompletedProcess(command, 0, "added 3 packages", "")


def test_an_install_is_marked_readable_and_found_again_without_running_npm(tmp_path):
    harness = HARNESSES["pi"]
    registry = FakeRegistry(harness)
    target = install(harness, tmp_path, run=registry)
    assert target == tmp_path / "pi-0.73.1" and installed(harness, tmp_path) == target
    assert registry.calls[0][:3] == ["npm", "install", "--prefix"]
    assert registry.calls[0][-1] == "@mariozechner/pi-coding-agent@0.73.1"
    marker = json.loads((target / MARKER).read_text())
    assert marker["spec"] == harness.spec and str(target) in marker["commands"][0]
    assert (target / harness.entry).stat().st_mode & 0o005 == 0o005  # others read, run
    assert install(harness, tmp_path, run=registry) == target and len(registry.calls) == 1
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []


def test_two_installs_at_once_install_once(tmp_path):
    harness = HARNESSES["codex"]
    registry = FakeRegistry(harness, delay_s=0.5)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        install(harness, tmp_path, run=registry))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(registry.calls) == 1 and results == [tmp_path / "codex-0.171.0"] * 2


def test_a_failed_or_crashed_install_is_never_used(tmp_path):
    harness = HARNESSES["claude-code"]
    with pytest.raises(HarnessError, match=r"(?s)claude-code.*npm install.*exited with 1.*404"):
        install(harness, tmp_path, run=FakeRegistry(harness, fail=True))
    with pytest.raises(HarnessError, match="has no program node_modules/.bin/claude"):
        install(harness, tmp_path, run=FakeRegistry(harness, entry=False))
    assert installed(harness, tmp_path) is None and sorted(os.listdir(tmp_path)) == [
        ".claude-code-2.1.197.lock"]
    # a crash mid-install left a staging directory, and a directory without its marker
    (tmp_path / ".claude-code-2.1.197.staging-dead").mkdir()
    (tmp_path / "claude-code-2.1.197" / "half").mkdir(parents=True)
    assert installed(harness, tmp_path) is None
    target = install(harness, tmp_path, run=FakeRegistry(harness))
    assert not (target / "half").exists() and (target / MARKER).is_file()
    assert not (tmp_path / ".claude-code-2.1.197.staging-dead").exists()


def test_the_cache_is_where_the_variable_says(tmp_path, monkeypatch):
    monkeypatch.setenv("LACHESIS_HARNESS_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("LACHESIS_HARNESS_CACHE")
    assert cache_root() == (Path("/var/cache/lachesis/harnesses") if os.geteuid() == 0
                            else Path.home() / ".cache/lachesis/harnesses")


# -- the launcher ------------------------------------------------------------------------------
def test_the_launcher_seeds_home_feeds_stdin_and_says_when_it_cannot_start(tmp_path):
    seed = tmp_path / "seed"
    (seed / ".cfg").mkdir(parents=True)
    (seed / ".cfg" / "a.json").write_text('{"x": 1}')
    (tmp_path / "stdin").write_text("the task")
    home = tmp_path / "home"
    read = "import os,sys; print(open(os.path.expanduser('~/.cfg/a.json')).read(), sys.stdin.read())"
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), "--home", str(seed), "--stdin", str(tmp_path / "stdin"),
         "--", sys.executable, "-c", read], env={**os.environ, "HOME": str(home)},
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '{"x": 1} the task'
    (home / ".cfg" / "a.json").write_text("the harness may write its home")
    missing = subprocess.run([sys.executable, str(LAUNCHER), "--", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 127 and "cannot start" in missing.stderr


# -- what a failure says -------------------------------------------------------------------
def test_an_agent_failure_says_its_model_calls_statuses_and_both_output_tails():
    env = HarnessEnv(BlackBoxEnvConfig())
    rollout = SimpleNamespace(segments=[], refused=0, abandoned=[], requests=6, limit=None,
                              failure=None, statuses=[404] * 6,
                              unserved=["POST /v1/responses"])
    state = SimpleNamespace(turns=[], extra={})
    result = ExecResult(exit_code=1, stdout="x" * 900 + "Error: model not found",
                        stderr="retrying...", duration_s=1.0)
    with pytest.raises(AgentError) as error:
        env._check_run("item-1", rollout, state, result)
    message = str(error.value)
    assert "without a recorded turn" in message and "6 model calls (HTTP 404, 404" in message
    assert "POST /v1/responses" in message
    assert "Error: model not found" in message and "retrying..." in message
    assert "x" * 600 not in message  # tails, not whole outputs
    rollout.requests, rollout.statuses, rollout.unserved = 0, [], []
    with pytest.raises(AgentError, match="exited with 1 without calling the model; it made 0"):
        env._check_run("item-1", rollout, state, result)
