"""Start an agent in a sandbox that has no network, with the model reachable on loopback.

    python3 launch.py --listen 8765 --socket /run/lachesis/proxy.sock \
        [--home SEED] [--stdin FILE] -- COMMAND...

Listens on ``127.0.0.1:PORT`` inside the sandbox and forwards every connection, byte for
byte, to the interception proxy's Unix socket (mounted read-only into the sandbox); then
runs ``COMMAND`` and exits with its status, printing the last 4 KiB of its stdout and
stderr. The agent sees an ordinary HTTP endpoint
(``OPENAI_BASE_URL=http://127.0.0.1:PORT/rollout/ID/v1``); the sandbox can reach nothing
else. Without ``--listen`` / ``--socket`` nothing is forwarded (the agent reaches the
proxy itself). ``--home SEED``: first copy the directory SEED (a harness's config files,
mounted read-only) into ``$HOME``, creating it. ``--stdin FILE``: the agent's standard
input (default: the launcher's). A command that cannot be started exits 127 with one line
saying why. Standard library only: it runs under the sandbox's own ``python3``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys

TAIL_BYTES = 4096


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


def seed_home(seed: str) -> None:
    """Copy the tree ``seed`` into ``$HOME`` (made if missing; files writable)."""
    home = os.environ.get("HOME")
    if not home:
        raise SystemExit("launch: --home needs HOME set")
    os.makedirs(home, exist_ok=True)
    shutil.copytree(seed, home, dirs_exist_ok=True, copy_function=shutil.copyfile)


async def main(port: int | None, socket_path: str | None, command: list[str],
               stdin_path: str | None = None) -> int:
    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(socket_path)
        except OSError as error:
            print(f"launch: cannot reach the model at {socket_path}: {error}", file=sys.stderr)
            writer.close()
            return
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    async def tail(stream: asyncio.StreamReader, out) -> None:
        """Keep the last TAIL_BYTES of the agent's output (a chatty agent must not hit
        the sandbox's output limit); written out when it exits."""
        kept = b""
        while data := await stream.read(65536):
            kept = (kept + data)[-TAIL_BYTES:]
        out.buffer.write(kept)
        out.flush()

    async def run() -> int:
        stdin = open(stdin_path, "rb") if stdin_path else None
        try:
            agent = await asyncio.create_subprocess_exec(
                *command, stdin=stdin, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
        except OSError as error:
            print(f"launch: cannot start {command[0]}: {error}", file=sys.stderr)
            return 127
        finally:
            if stdin is not None:
                stdin.close()
        await asyncio.gather(tail(agent.stdout, sys.stdout), tail(agent.stderr, sys.stderr))
        return await agent.wait()

    if port is None:
        return await run()
    server = await asyncio.start_server(forward, "127.0.0.1", port)
    async with server:
        return await run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=int)
    parser.add_argument("--socket")
    parser.add_argument("--home", help="copy this directory into $HOME first")
    parser.add_argument("--stdin", help="the agent's standard input")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no agent command after --")
    if (args.listen is None) != (args.socket is None):
        parser.error("--listen and --socket go together")
    if args.home:
        seed_home(args.home)
    sys.exit(asyncio.run(main(args.listen, args.socket, command, args.stdin)))
