"""Call a solution's functions from a grader that never shares its address space, with
plain data.

A grader that imports the code it grades shares its address space: the code can read the
grader's frames, its memory, its secrets, and print whatever the grader would print. Here
:data:`GRADER_PRELUDE` is the start of a grader script (run as ``python3 -I -S`` in a
fresh sandbox, the solution's module beside it) that keeps the two apart:

1. it reads its secrets (``spec.json``: the hidden tests, the expected values, a nonce)
   into a single bytearray, straight from the file (no other copy), and deletes the file;
2. it makes itself undumpable (``prctl(PR_SET_DUMPABLE, 0)``): no other process of the
   sandbox, though it runs as the same uid, can read its memory, file descriptors or
   environment through ``/proc``, or ptrace it;
3. it forks. The child zeroes its copy of the bytearray, points stdin/stdout/stderr at
   ``/dev/null``, closes every descriptor but its end of a socket pair, and only then
   imports the solution and serves calls on the socket: a request
   ``{"call": name, "args": [...], "kwargs": {...}}`` per line, a reply ``{"value": ...}``
   or ``{"error": "..."}`` per line;
4. the parent decodes its secrets and calls the solution through proxies. Values cross as
   JSON with tags for what JSON lacks (tuples, sets, bytes, non-string dict keys,
   infinities, complex numbers) and decode to builtin types only, so a solution cannot
   hand the grader an object with its own ``__eq__``. The grader compares the values
   itself and prints its verdict with the nonce on its own stdout.

If the solution exits, hangs or garbles the channel, the grader's calls fail (or the
sandbox's timeout ends it): no verdict. Both sides import only C modules for the channel
(``_json``, ``_socket``): ``json`` and ``socket`` would double the start-up time.
"""

from __future__ import annotations

CODEC = r'''
import math
import sys

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

GRADER_PRELUDE = CODEC + r'''
import _socket
import os


class SolutionError(Exception):
    """The solution's function raised, or the solution process is gone."""


def read_secrets(path):
    """The file's bytes in a bytearray (their only copy in this process); the file is
    removed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    size = os.fstat(fd).st_size
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if not n:
            break
        got += n
    view.release()
    os.close(fd)
    os.remove(path)
    return data


def undumpable():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0):  # PR_SET_DUMPABLE
        raise SystemExit("prctl(PR_SET_DUMPABLE) failed: errno %d" % ctypes.get_errno())


def serve(sock, module_name, names):
    """The solution's side (the forked child): import it, answer calls until EOF."""
    sys.path.insert(0, os.getcwd())
    try:
        module = __import__(module_name)
    except ImportError:  # maybe an installed package: -S left site-packages off the path
        import site
        sys.path.extend(p for p in site.getsitepackages() if os.path.isdir(p))
        module = __import__(module_name)
    functions = {name: getattr(module, name, None) for name in names}
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


def start_solution(secrets, module_name, names):
    """Fork the solution's process; returns (its pid, a function that makes proxies)."""
    undumpable()
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            secrets[:] = bytes(len(secrets))
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            keep = theirs.fileno()
            os.closerange(3, keep)
            os.closerange(keep + 1, 1 << 16)
            serve(theirs, module_name, names)
        finally:
            os._exit(0)
    theirs.close()
    stream = open(ours.fileno(), "rb", closefd=False)

    def proxy(name, max_line=64 << 20):
        def call(*args, **kwargs):
            request = {"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)}
            ours.sendall(dumps(request).encode() + b"\n")
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

    return pid, proxy
'''
