"""``python -m environments.sandbox {check,build-image,start-dockerd,reap}``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys


def _check(backend: str, image: str | None) -> dict:
    from environments.sandbox import SandboxConfig, create_sandbox

    async def go() -> dict:
        async with await create_sandbox(SandboxConfig(backend=backend, image=image)) as box:
            result = await box.exec("python3 -c 'import sys; print(sys.version.split()[0])'; "
                                    "id -u; cat /proc/net/dev | tail -n +3 | cut -d: -f1")
        lines = result.stdout.split()
        return {"backend": backend, "ok": result.ok, "python": lines[0] if lines else None,
                "uid": lines[1] if len(lines) > 1 else None, "interfaces": lines[2:]}

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m environments.sandbox")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run a command in a sandbox of each backend given")
    check.add_argument("--backend", action="append", default=None)
    check.add_argument("--image", default=None)
    build = sub.add_parser("build-image", help="build the default docker image (debootstrap)")
    build.add_argument("--tag", default=None)
    build.add_argument("--force", action="store_true", help="rebuild even if it exists")
    sub.add_parser("start-dockerd", help="start dockerd (no iptables, vfs) if none answers")
    reap = sub.add_parser("reap", help="remove sandboxes left by dead processes")
    reap.add_argument("--backend", default="all")
    reap.add_argument("--max-age-s", type=float, default=None,
                      help="also remove sandboxes of live processes older than this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    from environments.sandbox import SandboxError

    try:
        if args.command == "check":
            out = [_check(b, args.image) for b in args.backend or ["bwrap"]]
        elif args.command == "build-image":
            from environments.sandbox.images import (
                build_image,
                default_image,
                image_exists,
            )

            tag = args.tag or default_image()
            out = ({"image": tag, "built": False} if image_exists(tag) and not args.force
                   else {**build_image(tag), "built": True})
        elif args.command == "start-dockerd":
            from environments.sandbox.images import ensure_dockerd

            proc = ensure_dockerd()
            out = {"started": proc is not None, "pid": proc.pid if proc else None}
        else:
            from environments.sandbox import reap as reap_sandboxes

            out = {"removed": reap_sandboxes(args.backend, max_age_s=args.max_age_s)}
    except SandboxError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
