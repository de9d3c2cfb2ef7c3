"""Call a solution's functions from a grader that runs in another sandbox, with plain data.

A grader that imports the code it grades shares its address space: the code can read the
grader's frames, its memory, its secrets, and print whatever the grader would print. Here
the two never meet. The grader runs in one sandbox, the solution in another (each exec its
own pid namespace, so neither can see the other's processes, /proc or file descriptors),
and this process relays bytes between them over two Unix sockets, one private directory
per side, each mounted read-only into its own sandbox only::

    grader sandbox --(grader.sock)--> this process --(solution.sock)--> solution sandbox

The grader sends ``{"call": name, "args": [...], "kwargs": {...}}`` lines and reads
``{"value": ...}`` or ``{"error": "..."}`` lines back; values cross as JSON with tags for
what JSON lacks (:data:`CODEC`: tuples, sets, bytes, non-string dict keys), and decode to
builtin types only, so a solution cannot hand the grader an object with its own ``__eq__``.
The grader compares the returned values itself and prints its verdict on its own stdout,
which nothing of the solution can reach. If the solution process ends (or never starts
serving), the relay closes the grader's connection: every pending and later call fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from environments.sandbox import ExecResult, Sandbox

MOUNT = "/run/lachesis-bridge"
"""Where each sandbox sees its side's socket directory."""

CODEC = r'''
import math
import sys

# Both sides run as ``python3 -I -S`` and import only C modules here: ``json`` (with
# ``re``) and ``socket`` (with ``enum``, ``selectors``) would double the start-up time.
try:
    import _json

    class _Options:
        strict, object_hook, object_pairs_hook = True, None, None
        parse_float, parse_int = float, int
        parse_constant = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get

    def _refuse(value):
        raise TypeError("not JSON: %s" % type(value).__name__)

    _scan = _json.make_scanner(_Options())
    _encode = _json.make_encoder(None, _refuse, _json.encode_basestring_ascii, None, ":", ",",
                                 False, False, True)

    def loads(text):
        try:
            value, end = _scan(text, 0)
        except StopIteration:
            raise ValueError("malformed JSON") from None
        if text[end:].strip():
            raise ValueError("malformed JSON")
        return value

    def dumps(value):
        return "".join(_encode(value, 0))
except (ImportError, AttributeError, TypeError):
    from json import dumps, loads

_SCALARS = (str, int, float, bool, type(None))


def encode(value, depth=0):
    if depth > 100:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if kind in _SCALARS:
        if kind is float and not math.isfinite(value):
            return {"t": "float", "v": repr(value)}
        return value
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": "tuple", "v": [encode(v, depth + 1) for v in value]}
    if kind in (set, frozenset):
        return {"t": kind.__name__, "v": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"t": "dict", "v": [[encode(k, depth + 1), encode(v, depth + 1)]
                                   for k, v in value.items()]}
    if kind in (bytes, bytearray):
        return {"t": "bytes", "v": bytes(value).hex()}
    if kind is complex:
        return {"t": "complex", "v": [value.real, value.imag]}
    raise TypeError("cannot send a %s across the call boundary" % kind.__name__)


def decode(value, depth=0):
    if depth > 100:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        return [decode(v, depth + 1) for v in value]
    if kind is not dict or set(value) != {"t", "v"}:
        raise ValueError("malformed value")
    tag, inner = value["t"], value["v"]
    if tag == "float" and inner in ("nan", "inf", "-inf"):
        return float(inner)
    if tag == "bytes" and type(inner) is str:
        return bytes.fromhex(inner)
    if tag == "complex" and type(inner) is list and len(inner) == 2:
        return complex(float(inner[0]), float(inner[1]))
    if type(inner) is not list:
        raise ValueError("malformed value")
    items = [decode(v, depth + 1) for v in inner]
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    if tag == "dict" and all(type(p) is list and len(p) == 2 for p in items):
        return {k: v for k, v in items}
    raise ValueError("malformed value")
'''

SOLUTION_HOST = CODEC + r'''
import _socket
import os


def serve(path, module_name, names):
    sys.path.insert(0, os.getcwd())
    try:
        module = __import__(module_name)
    except ImportError:  # maybe an installed package: -S left site-packages off the path
        import site
        sys.path.extend(p for p in site.getsitepackages() if os.path.isdir(p))
        module = __import__(module_name)
    functions = {name: getattr(module, name, None) for name in names}
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.connect(path)
    for line in open(sock.fileno(), "rb", closefd=False):
        try:
            request = loads(line.decode())
            function = functions.get(request["call"])
            if not callable(function):
                raise NameError("the solution defines no function %r" % request["call"])
            args, kwargs = decode(request["args"]), decode(request["kwargs"])
            reply = {"value": encode(function(*args, **kwargs))}
        except Exception as error:
            reply = {"error": "%s: %s" % (type(error).__name__, error)}
        sock.sendall(dumps(reply).encode() + b"\n")


serve(sys.argv[1], sys.argv[2], sys.argv[3:])
'''

GRADER_CLIENT = CODEC + r'''
import _socket


class SolutionError(Exception):
    """The solution's function raised, or the solution process is gone."""


def connect(path, max_line=64 << 20):
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.connect(path)
    stream = open(sock.fileno(), "rb", closefd=False)

    def proxy(name):
        def call(*args, **kwargs):
            request = {"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)}
            sock.sendall(dumps(request).encode() + b"\n")
            line = stream.readline(max_line)
            if not line.endswith(b"\n"):
                raise SolutionError("the solution process is gone")
            reply = loads(line.decode("utf-8", "replace"))
            if type(reply) is not dict:
                raise SolutionError("malformed reply")
            if "error" in reply:
                raise SolutionError(str(reply["error"]))
            return decode(reply["value"])
        call.__name__ = name
        return call

    return proxy, loads
'''


@dataclass
class BridgeRun:
    grader: ExecResult
    solution: ExecResult | None
    """None when the solution was still running when the grader finished (then killed)."""


class CallBridge:
    """Two private socket directories (0o711, random socket names) and the relay between
    them; ``async with CallBridge() as bridge``."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="lachesis-bridge-"))
        self.root.chmod(0o711)
        self.sides = {}
        for side in ("grader", "solution"):
            directory = self.root / side
            directory.mkdir(mode=0o711)
            self.sides[side] = (directory, f"{secrets.token_hex(8)}.sock")
        self._accepted: dict[str, asyncio.Future] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self._writers: list[asyncio.StreamWriter] = []

    def mounts(self, side: str, backend: str) -> dict[str, str]:
        """``ro_mounts`` for the sandbox of ``side`` (none for unsafe_subprocess, which
        sees host paths as they are)."""
        return {} if backend == "unsafe_subprocess" else {str(self.sides[side][0]): MOUNT}

    def path(self, side: str, backend: str) -> str:
        """The socket's path as the sandbox of ``side`` sees it."""
        directory, name = self.sides[side]
        return str(directory / name) if backend == "unsafe_subprocess" else f"{MOUNT}/{name}"

    async def __aenter__(self) -> CallBridge:
        loop = asyncio.get_running_loop()
        for side, (directory, name) in self.sides.items():
            accepted = self._accepted[side] = loop.create_future()

            def on_connect(reader, writer, accepted=accepted):
                self._writers.append(writer)
                if accepted.done():  # one peer per side: anyone else is turned away
                    writer.close()
                else:
                    accepted.set_result((reader, writer))

            server = await asyncio.start_unix_server(on_connect, path=str(directory / name))
            self._servers.append(server)
            os.chmod(directory / name, 0o777)  # sandbox uids differ from ours
        return self

    async def __aexit__(self, *exc) -> None:
        for server in self._servers:
            server.close()
        for writer in self._writers:
            writer.close()
        shutil.rmtree(self.root, ignore_errors=True)

    async def relay(self, solution_exec: asyncio.Future) -> None:
        """Pipe bytes between the grader and the solution until either side closes; if
        the solution's exec ends before it connects, close the grader's connection."""
        grader_reader, grader_writer = await self._accepted["grader"]
        solution = asyncio.ensure_future(asyncio.shield(self._accepted["solution"]))
        await asyncio.wait({solution, solution_exec}, return_when=asyncio.FIRST_COMPLETED)
        if not solution.done():
            solution.cancel()
            grader_writer.close()
            return
        solution_reader, solution_writer = solution.result()
        pumps = [asyncio.ensure_future(_pump(grader_reader, solution_writer)),
                 asyncio.ensure_future(_pump(solution_reader, grader_writer))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        grader_writer.close()
        solution_writer.close()

    async def run(self, grader_box: Sandbox, grader_argv: list[str], solution_box: Sandbox,
                  solution_argv: list[str], timeout_s: float) -> BridgeRun:
        """Run both sides, relaying between them; the solution is killed when the grader
        is done."""
        solution_exec = asyncio.ensure_future(solution_box.exec(solution_argv,
                                                                timeout_s=timeout_s))
        relay = asyncio.ensure_future(self.relay(solution_exec))
        try:
            grader = await grader_box.exec(grader_argv, timeout_s=timeout_s)
        finally:
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay
            for writer in self._writers:
                writer.close()
        if not solution_exec.done():
            await solution_box.close()  # kills what is left of it
        with contextlib.suppress(Exception, asyncio.CancelledError):
            return BridgeRun(grader, await solution_exec)
        return BridgeRun(grader, None)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while chunk := await reader.read(1 << 16):
            writer.write(chunk)
            await writer.drain()
