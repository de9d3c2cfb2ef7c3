"""``lachesis``: the command line. Each subcommand starts one process of the system."""

from __future__ import annotations

import argparse
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
    p.add_argument("--token", help="bearer token required on every endpoint (or LACHESIS_API_TOKEN)")
    p.add_argument("--max-body-mb", type=float, help="largest request body, MiB (default 64)")
    p.add_argument("--lease-timeout-s", type=float, help="redeliver unacknowledged leases after this")
    p.add_argument("--max-staleness", type=int,
                   help="drop groups more than this many policy versions old")
    p.set_defaults(run=_run_api)


def _run_api(args: argparse.Namespace) -> int:
    from environments.api.schemas import APIConfig
    from environments.api.server import serve

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lachesis", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_api(subparsers)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
