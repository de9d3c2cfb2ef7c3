"""The env kinds Lachesis ships (other frameworks' envs), registered with the env registry.

The same kinds are declared as entry points in ``pyproject.toml`` (group
``lachesis.env_kinds``), where third-party packages add theirs; registering them here as
well keeps them working from a source checkout whose installed metadata predates them.
"""

from __future__ import annotations

from environments.framework import registry

BUILTIN_KINDS = {
    "verifiers": "environments.adapters.verifiers_env:verifiers_env_class",
    "openenv": "environments.adapters.openenv_env:openenv_env_class",
    "gym": "environments.adapters.gym_env:gym_env_class",
}
"""``KIND: module:function`` (the function takes what follows ``KIND:``)."""


def register_builtin_kinds() -> None:
    for name, target in BUILTIN_KINDS.items():
        registry.register_env_kind(name, target, source="lachesis")


def load_env_class(name: str) -> type:
    """The env class of ``name`` (:func:`environments.framework.registry.load_env_class`)
    with Lachesis's own kinds registered."""
    register_builtin_kinds()
    return registry.load_env_class(name)


def atropos_env_class(name: str) -> type | None:
    """The atroposlib ``BaseEnv`` subclass that ``name`` names (``package.module:Class``
    or ``path/to/file.py:Class``), or None when it names anything else. Such an env runs
    its own serve loop (``Class.cli()``) against ``lachesis api``, with atroposlib's tool
    call parsing working on this vLLM (:mod:`environments.inference.vllm_compat`)."""
    from environments.inference import vllm_compat

    register_builtin_kinds()
    if name in registry.ENVIRONMENTS or name.partition(":")[0] in registry.env_kinds():
        return None
    vllm_compat.install()  # before the env's module imports atroposlib
    try:
        target = registry.load_target(name)
    except registry.EnvNotFoundError:
        return None
    if isinstance(target, type) and any(
            c.__name__ == "BaseEnv" and c.__module__.startswith("atroposlib.")
            for c in target.__mro__):
        return target
    return None


ATROPOS_WIRED = {"env": {"rollout_server_url", "tokenizer_name", "use_wandb",
                         "inference_weight"},
                 "openai": {"base_url", "tokenizer_name", "model_name", "server_type"}}
"""Settings of an atroposlib env that ``lachesis run`` sets itself."""


def env_facts(name: str, settings: dict) -> dict:
    """What ``lachesis run`` needs to know of the env ``name`` with ``settings`` (checked
    against its config class): ``kind`` (``lachesis`` or ``atropos``), ``group_size``,
    ``max_token_length``, ``max_tokens_per_turn`` (None: no such setting). Raises ValueError (or LookupError: not found) saying what is
    wrong."""
    atropos = atropos_env_class(name)
    if atropos is not None:
        wrong = sorted(set(settings) - set(ATROPOS_WIRED))
        if wrong:
            raise ValueError(f"an atroposlib env's settings are `env:` and `openai:` "
                             f"(its --env.* and --openai.* flags), not {', '.join(wrong)}")
        for section, wired in ATROPOS_WIRED.items():
            taken = sorted(set(settings.get(section) or {}) & wired)
            if taken:
                raise ValueError(f"{section}: {', '.join(taken)} are set by `lachesis run` "
                                 "itself; remove them")
        defaults, _ = atropos.config_init()
        config = type(defaults).model_validate({**defaults.model_dump(),
                                                **(settings.get("env") or {})})
        return {"kind": "atropos", "group_size": config.group_size,
                "max_token_length": config.max_token_length, "max_tokens_per_turn": None}
    config = load_env_class(name).config_class.model_validate(settings)
    return {"kind": "lachesis", "group_size": config.group_size,
            "max_token_length": config.max_token_length,
            "max_tokens_per_turn": getattr(config, "max_tokens_per_turn", None)}


def main(argv: list[str] | None = None) -> int:
    """``python -m lachesis.env_kinds NAME SETTINGS_JSON``: :func:`env_facts` as JSON, for
    an env whose processes run in another interpreter (``lachesis run`` asks that
    interpreter); the error on stderr, exit 2 (bad settings) or 3 (not found)."""
    import json
    import sys

    from pydantic import ValidationError

    name, settings = argv if argv is not None else sys.argv[1:3]
    try:
        print(json.dumps(env_facts(name, json.loads(settings))))
    except LookupError as error:
        print(f"{error}", file=sys.stderr)
        return 3
    except (ValueError, ValidationError) as error:
        print(f"{error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def atropos_token_origins(argv: list[str]) -> set[str]:
    """The servers an atroposlib env started as ``NAME serve --config FILE ...`` talks to
    that want the run's token: its rollout API and its inference servers (the
    ``lachesis atropos-generate`` of the run), as ``scheme://host:port``."""
    import yaml

    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return set()
    settings = yaml.safe_load(open(argv[argv.index("--config") + 1])) or {}
    env, openai = settings.get("env") or {}, settings.get("openai") or {}
    urls = [env.get("rollout_server_url")]
    urls += [s.get("base_url") for s in (openai if isinstance(openai, list) else [openai])
             if isinstance(s, dict)]
    return {origin(u) for u in urls if isinstance(u, str) and u}


def origin(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def send_token_to(origins: set[str], token: str) -> None:
    """Make every aiohttp and httpx request of this process to one of ``origins`` carry
    ``Authorization: Bearer TOKEN`` (an unchanged atroposlib env makes its own sessions,
    without a header: its rollout-API calls have none, its inference calls the configured
    ``api_key``). Requests elsewhere are left as they are: the token goes nowhere else.
    httpx's async client and, where installed, httpx2's (the client of openai 3.x, through
    which atroposlib's ``chat_completion`` goes) are both covered."""
    import importlib

    import aiohttp

    header = f"Bearer {token}"
    request = aiohttp.ClientSession._request

    async def _request(self, method, str_or_url, *args, headers=None, **kwargs):
        if origin(str(self._build_url(str_or_url))) in origins:
            headers = {**dict(headers or {}), "Authorization": header}
        return await request(self, method, str_or_url, *args, headers=headers, **kwargs)

    aiohttp.ClientSession._request = _request
    for name in ("httpx", "httpx2"):
        try:
            client = importlib.import_module(name).AsyncClient
        except ImportError:
            continue
        client.send = _send_with_token(client.send, origins, header)


def _send_with_token(send, origins: set[str], header: str):
    """``AsyncClient.send`` of httpx or httpx2, adding ``header`` for ``origins``."""

    async def send_with_token(self, request, *args, **kwargs):
        if origin(str(request.url)) in origins:
            request.headers["Authorization"] = header
        return await send(self, request, *args, **kwargs)

    return send_with_token
