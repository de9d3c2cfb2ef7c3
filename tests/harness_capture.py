"""A capture server for agent harnesses: it speaks the four wire APIs just enough to
drive a harness through a two-turn episode and logs every request it gets.

    python tests/harness_capture.py --port 8799 --out /tmp/capture/pi
    python tests/harness_capture.py --harness pi --out tests/fixtures/harness_requests/pi

The harness is pointed at ``http://127.0.0.1:PORT/rollout/capture/v1`` (Anthropic clients
at ``http://127.0.0.1:PORT/rollout/capture``: they append ``/v1/messages``), the path
shape of the interception proxy. Replies, in the dialect of the path asked:

* ``POST .../chat/completions``: Chat Completions (JSON, or SSE ``chat.completion.chunk``
  when ``stream`` is set, with a usage chunk when ``stream_options.include_usage``);
* ``POST .../responses``: the Responses API (a Response object, or the SSE events
  ``response.created``, ``response.in_progress``, ``response.output_item.added``, the
  argument / text deltas, ``response.output_item.done``, ``response.completed``);
* ``POST .../messages``: Anthropic Messages (JSON, or the named SSE events
  ``message_start`` ... ``message_stop``); ``POST .../messages/count_tokens`` answers
  ``{"input_tokens": N}``;
* ``POST .../v1beta/models/M:generateContent`` / ``:streamGenerateContent`` (``alt=sse``):
  Google Gemini; ``:countTokens`` answers ``{"totalTokens": N}``;
* ``GET .../models``: a model list; any other ``GET`` / ``HEAD``: 200 ``{}``.

What it answers: when the conversation already carries a tool result, the final text
``done``; else, when the request offers a shell tool (``bash``, ``Bash``, ``shell``,
``exec_command``, ...), one call of it running ``echo 42 > answer.txt``; else, for a
request without tools asking for a *file listing* (Aider's ``whole`` edit format), the
listing of answer.txt holding 42; else (a title or summary request without tools) the
text ``done``.

Every request is written to ``OUT/NN-METHOD-PATH.json`` (``NN``: the order of arrival;
``PATH``: the path after the ``/rollout/capture`` prefix, ``/`` as ``_``): method, path,
query, headers (credentials redacted) and the body (parsed JSON, or text). Standard
library and aiohttp only (``--harness NAME`` imports Lachesis: it installs the catalog's
harness and runs it in a bwrap or docker sandbox exactly as a black-box env does, the
requests reaching this server through the launcher's forwarding, and checks that the
harness ran its tool call).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

PREFIX = "/rollout/capture"
COMMAND = "echo 42 > answer.txt"
SHELL_NAMES = ("bash", "Bash", "shell", "exec_command", "run_shell_command", "shell_command",
               "execute_bash", "terminal", "run_command", "exec")
SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization",
                  "anthropic-api-key", "openai-api-key", "x-goog-api-key"}
MODEL = "tiny"
USAGE = {"input_tokens": 100}
"""The input token count the replies report (``--input-tokens``: to see what a harness
does when its context fills up, e.g. whether it compacts)."""


def redact_headers(headers: Any) -> dict[str, str]:
    out = {}
    for key, value in headers.items():
        if key.lower() in SECRET_HEADERS:
            value = value.split(" ")[0] + " <redacted>" if " " in value else "<redacted>"
        out[key] = value
    return out


# -- what to answer ----------------------------------------------------------------------
def _tool_schema(tool: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(name, JSON schema of the arguments) of a tool in any of the four dialects."""
    if "function" in tool and isinstance(tool["function"], dict):  # chat completions
        return tool["function"].get("name"), tool["function"].get("parameters") or {}
    if tool.get("type") == "function":  # responses, flat
        return tool.get("name"), tool.get("parameters") or {}
    if "input_schema" in tool:  # anthropic
        return tool.get("name"), tool.get("input_schema") or {}
    return tool.get("name"), tool.get("parameters") or {}


def _all_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The tools, with those inside Responses ``namespace`` tools and Gemini
    ``functionDeclarations`` flattened out."""
    found = []
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        found.append(tool)
        if tool.get("type") == "namespace":
            found += _all_tools(tool.get("tools") or [])
        for declaration in tool.get("functionDeclarations") or []:
            if isinstance(declaration, dict):
                found.append({**declaration, "parameters": declaration.get(
                    "parametersJsonSchema") or declaration.get("parameters") or {}})
    return found


def shell_call(tools: list[Any]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a call of the request's shell tool, or None if it has none."""
    by_name = {}
    for tool in _all_tools(tools):
        name, schema = _tool_schema(tool)
        if name:
            by_name.setdefault(name, schema)
    for wanted in SHELL_NAMES:
        if wanted in by_name:
            return wanted, shell_arguments(by_name[wanted])
    return None


def shell_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments that run COMMAND: the command property (a string, or an argv list), and
    a plain value for every other required property."""
    properties = schema.get("properties") or {}
    args: dict[str, Any] = {}
    key = next((k for k in ("command", "cmd", "script", "input") if k in properties),
               "command")
    kind = (properties.get(key) or {}).get("type")
    args[key] = ["bash", "-lc", COMMAND] if kind == "array" else COMMAND
    for name in schema.get("required") or []:
        if name in args:
            continue
        kind = (properties.get(name) or {}).get("type")
        args[name] = ({"integer": 60000, "number": 60000, "boolean": False, "array": [],
                       "object": {}}.get(kind, "Write the answer file"))
    return args


def has_tool_result(body: dict[str, Any]) -> bool:
    for message in body.get("messages") or []:  # chat completions, anthropic
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            return True
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") ==
                                             "tool_result" for b in content):
            return True
    for content in body.get("contents") or []:  # gemini
        if isinstance(content, dict) and any(isinstance(p, dict) and "functionResponse" in p
                                             for p in content.get("parts") or []):
            return True
    items = body.get("input")
    if isinstance(items, list):  # responses
        return any(isinstance(i, dict) and i.get("type") in
                   ("function_call_output", "custom_tool_call_output",
                    "local_shell_call_output") for i in items)
    return False


SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent ends when a command prints this (a reply without a tool call is a
format error there, answered with a new request)."""


def decide(body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The tool call to make, or None for the final text. An agent whose prompt asks for
    SUBMIT gets the shell call, then the text "done" (its format error is captured: it
    leaves that reply out of the history), then a call of ``echo SUBMIT``."""
    call = shell_call(body.get("tools") or [])
    history = body.get("messages") or []
    if call and SUBMIT in json.dumps(history):
        replies = sum(isinstance(m, dict) and m.get("role") == "assistant" for m in history)
        last = history[-1] if history and isinstance(history[-1], dict) else {}
        if replies and last.get("role") == "tool":
            return None  # the format error to come
        if replies:  # the format error came: submit
            name, args = call
            key = next(k for k, v in args.items() if v in (COMMAND, ["bash", "-lc", COMMAND]))
            return name, {**args, key: f"echo {SUBMIT}"}
        return call
    if has_tool_result(body):
        return None
    return call


FILE_LISTING = "answer.txt\n```\n42\n```\n"
"""The reply to an agent that edits files through text, not tools (Aider's ``whole`` edit
format: the file's name, then its whole content fenced): writes 42 to answer.txt."""


def final_text(body: dict[str, Any]) -> str:
    """The text of a reply without a tool call: a file listing for a request without tools
    that asks for one (Aider), else ``done``."""
    if not body.get("tools") and not has_tool_result(body) and "*file listing*" in \
            json.dumps((body.get("messages") or [])[-1:]):
        return FILE_LISTING
    return "done"


# -- the server ---------------------------------------------------------------------------
class Capture:
    def __init__(self, out: Path):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.counter = itertools.count(1)
        self.log: list[str] = []

    def record(self, request: web.Request, body: Any) -> None:
        n = next(self.counter)
        path = request.path.removeprefix(PREFIX)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", path.strip("/")) or "root"
        name = f"{n:02d}-{request.method.lower()}-{slug}.json"
        entry = {"method": request.method, "path": path, "query": dict(request.query),
                 "headers": redact_headers(request.headers), "body": body}
        (self.out / name).write_text(json.dumps(entry, indent=1, ensure_ascii=False) + "\n")
        self.log.append(name)
        print(f"capture: {name}", flush=True)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", errors="replace")
        self.record(request, body)
        path = request.path
        if request.method == "POST" and isinstance(body, dict):
            if path.endswith("/messages/count_tokens"):
                return web.json_response({"input_tokens": max(1, len(raw) // 4)})
            if path.endswith("/chat/completions"):
                return await chat(request, body)
            if path.endswith("/responses"):
                return await responses(request, body)
            if path.endswith("/messages"):
                return await messages(request, body, len(raw) // 4)
            if path.endswith(":countTokens"):
                return web.json_response({"totalTokens": max(1, len(raw) // 4)})
            if path.endswith(("generateContent", "GenerateContent")):
                return await gemini(request, body)
        if request.method in ("GET", "HEAD"):
            if path.endswith("/models"):
                return web.json_response({"object": "list", "data": [
                    {"id": MODEL, "object": "model", "created": 0, "owned_by": "capture",
                     "type": "model", "display_name": MODEL,
                     "created_at": "2026-01-01T00:00:00Z"}],
                    "has_more": False, "first_id": MODEL, "last_id": MODEL})
            return web.json_response({})
        return web.json_response({"error": {"message": f"not served: {request.method} {path}",
                                            "type": "not_found_error"}}, status=404)


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


async def _start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def chat(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    call = decide(body)
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time())
    n = USAGE["input_tokens"]
    usage = {"prompt_tokens": n, "completion_tokens": 10, "total_tokens": n + 10}
    if call:
        name, args = call
        tool_call = {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
                     "function": {"name": name, "arguments": json.dumps(args)}}
        message, finish = {"role": "assistant", "content": None,
                           "tool_calls": [tool_call]}, "tool_calls"
    else:
        message, finish = {"role": "assistant", "content": final_text(body)}, "stop"
    if not body.get("stream"):
        return web.json_response({"id": rid, "object": "chat.completion", "created": created,
                                  "model": body.get("model", MODEL), "choices": [
                                      {"index": 0, "message": message, "finish_reason": finish,
                                       "logprobs": None}], "usage": usage})
    response = await _start_sse(request)

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                     "model": body.get("model", MODEL), "choices": [
                         {"index": 0, "delta": delta, "finish_reason": finish_reason,
                          "logprobs": None}]})

    await response.write(chunk({"role": "assistant", "content": ""}))
    if call:
        tc = message["tool_calls"][0]
        await response.write(chunk({"tool_calls": [{"index": 0, "id": tc["id"],
                                                    "type": "function", "function": {
                                                        "name": tc["function"]["name"],
                                                        "arguments": ""}}]}))
        await response.write(chunk({"tool_calls": [{"index": 0, "function": {
            "arguments": tc["function"]["arguments"]}}]}))
    else:
        await response.write(chunk({"content": final_text(body)}))
    await response.write(chunk({}, finish))
    if (body.get("stream_options") or {}).get("include_usage"):
        await response.write(_sse({"id": rid, "object": "chat.completion.chunk",
                                   "created": created, "model": body.get("model", MODEL),
                                   "choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def responses(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    call = decide(body)
    rid, created = f"resp_{uuid.uuid4().hex[:16]}", int(time.time())
    if call:
        name, args = call
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:12]}",
                "call_id": f"call_{uuid.uuid4().hex[:8]}", "name": name,
                "arguments": json.dumps(args), "status": "completed"}
    else:
        item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:12]}", "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "done", "annotations": []}]}
    n = USAGE["input_tokens"]
    usage = {"input_tokens": n, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": n + 10}

    def response_object(status: str, output: list[Any]) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": created, "status": status,
                "model": body.get("model", MODEL), "output": output,
                "parallel_tool_calls": True, "tool_choice": body.get("tool_choice", "auto"),
                "tools": [], "error": None, "incomplete_details": None,
                "instructions": None, "metadata": {}, "temperature": 1.0, "top_p": 1.0,
                "usage": usage if status == "completed" else None}

    if not body.get("stream"):
        return web.json_response(response_object("completed", [item]))
    response = await _start_sse(request)
    seq = itertools.count()

    async def send(kind: str, **data: Any) -> None:
        await response.write(_sse({"type": kind, "sequence_number": next(seq), **data}, kind))

    await send("response.created", response=response_object("in_progress", []))
    await send("response.in_progress", response=response_object("in_progress", []))
    if call:
        await send("response.output_item.added", output_index=0,
                   item={**item, "arguments": "", "status": "in_progress"})
        await send("response.function_call_arguments.delta", item_id=item["id"],
                   output_index=0, delta=item["arguments"])
        await send("response.function_call_arguments.done", item_id=item["id"],
                   output_index=0, arguments=item["arguments"])
    else:
        part = {"type": "output_text", "text": "", "annotations": []}
        await send("response.output_item.added", output_index=0,
                   item={**item, "content": [], "status": "in_progress"})
        await send("response.content_part.added", item_id=item["id"], output_index=0,
                   content_index=0, part=part)
        await send("response.output_text.delta", item_id=item["id"], output_index=0,
                   content_index=0, delta="done")
        await send("response.output_text.done", item_id=item["id"], output_index=0,
                   content_index=0, text="done")
        await send("response.content_part.done", item_id=item["id"], output_index=0,
                   content_index=0, part={**part, "text": "done"})
    await send("response.output_item.done", output_index=0, item=item)
    await send("response.completed", response=response_object("completed", [item]))
    await response.write_eof()
    return response


async def messages(request: web.Request, body: dict[str, Any],
                   input_tokens: int) -> web.StreamResponse:
    call = decide(body)
    mid = f"msg_{uuid.uuid4().hex[:20]}"
    if call:
        name, args = call
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}", "name": name,
                 "input": args}
        stop = "tool_use"
    else:
        block, stop = {"type": "text", "text": "done"}, "end_turn"
    usage = {"input_tokens": USAGE.get("forced") or max(1, input_tokens), "output_tokens": 10,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    model = body.get("model", MODEL)
    if not body.get("stream"):
        return web.json_response({"id": mid, "type": "message", "role": "assistant",
                                  "model": model, "content": [block], "stop_reason": stop,
                                  "stop_sequence": None, "usage": usage})
    response = await _start_sse(request)

    async def send(kind: str, **data: Any) -> None:
        await response.write(_sse({"type": kind, **data}, kind))

    await send("message_start", message={"id": mid, "type": "message", "role": "assistant",
                                         "model": model, "content": [], "stop_reason": None,
                                         "stop_sequence": None,
                                         "usage": {**usage, "output_tokens": 1}})
    if call:
        await send("content_block_start", index=0, content_block={**block, "input": {}})
        await send("content_block_delta", index=0,
                   delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
    else:
        await send("content_block_start", index=0, content_block={"type": "text", "text": ""})
        await send("content_block_delta", index=0, delta={"type": "text_delta", "text": "done"})
    await send("content_block_stop", index=0)
    await send("message_delta", delta={"stop_reason": stop, "stop_sequence": None},
               usage={"output_tokens": 10})
    await send("message_stop")
    await response.write_eof()
    return response


async def gemini(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """Gemini ``generateContent`` (JSON) / ``streamGenerateContent`` (SSE with
    ``alt=sse``, else a JSON array of chunks)."""
    call = decide(body)
    if call:
        name, args = call
        part = {"functionCall": {"name": name, "args": args}}
    else:
        part = {"text": "done"}
    n = USAGE["input_tokens"]
    reply = {"candidates": [{"content": {"role": "model", "parts": [part]},
                             "finishReason": "STOP", "index": 0}],
             "usageMetadata": {"promptTokenCount": n, "candidatesTokenCount": 10,
                               "totalTokenCount": n + 10},
             "modelVersion": MODEL, "responseId": uuid.uuid4().hex[:16]}
    if not request.path.endswith(":streamGenerateContent"):
        return web.json_response(reply)
    if request.query.get("alt") != "sse":
        return web.json_response([reply])
    response = await _start_sse(request)
    await response.write(_sse(reply))
    await response.write_eof()
    return response


async def start_server(out: Path, port: int | None = None,
                       unix_path: Path | None = None) -> web.AppRunner:
    capture = Capture(out)
    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", capture.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    if port is not None:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    if unix_path is not None:
        await web.UnixSite(runner, str(unix_path)).start()
        unix_path.chmod(0o666)
    return runner


async def serve(port: int, out: Path) -> None:
    runner = await start_server(out, port=port)
    print(f"capture: listening on http://127.0.0.1:{port}{PREFIX}/v1, writing to {out}",
          flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


TASK = "Write the number 42 to answer.txt."


async def run_in_sandbox(name: str, out: Path, backend: str = "bwrap",
                         image: str | None = None, env: dict[str, str] | None = None,
                         memory_mb: int | None = None) -> int:
    """Install the catalog harness ``name``, run it in a sandbox exactly as a black-box
    env would (its install and config mounted read-only, ``$HOME`` seeded by the
    launcher, no network: the launcher forwards loopback to this server's Unix socket)
    through the two-turn episode, and check that its tool call ran (answer.txt)."""
    import shutil
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's code
    from environments.blackbox.agents.runtime import LAUNCHER, MOUNT, build_runtime
    from environments.blackbox.harness_cache import install
    from environments.blackbox.harnesses import (
        HARNESS_MOUNT, HOME_SEED, SANDBOX_HOME, RolloutSpec, get, write_seed)
    from environments.sandbox import SandboxConfig, create_sandbox

    harness = get(name)
    root = install(harness, log=print)
    work = Path(tempfile.mkdtemp(prefix="lachesis-capture-"))
    work.chmod(0o755)
    (work / "socket").mkdir(mode=0o755)
    (work / "seed").mkdir()
    runner = await start_server(out, unix_path=work / "socket" / "capture.sock")
    try:
        launch = harness.launch(RolloutSpec(
            base_url=f"http://127.0.0.1:8765{PREFIX}/v1", token="capture-token",
            model=MODEL, task=TASK, context_window=32768, max_output_tokens=1024))
        write_seed(work / "seed", launch.files, launch.stdin)
        options = ["--home", f"{HOME_SEED}/home"]
        if launch.stdin is not None:
            options += ["--stdin", f"{HOME_SEED}/stdin"]
        config = SandboxConfig(
            backend=backend, image=image, memory_mb=memory_mb or harness.memory_mb,
            timeout_s=300,
            cpu_time_s=600, max_output_bytes=1 << 20, ro_mounts={
                str(build_runtime()): MOUNT, str(work / "socket"): "/run/lachesis",
                str(root): HARNESS_MOUNT, str(work / "seed"): HOME_SEED})
        async with await create_sandbox(config) as box:
            result = await box.exec(
                ["python3", LAUNCHER, "--listen", "8765", "--socket",
                 "/run/lachesis/capture.sock", *options, "--", *launch.argv],
                env={**launch.env, **(env or {}), "HOME": SANDBOX_HOME})
            try:
                answer = (await box.read_file("answer.txt")).decode()
            except FileNotFoundError:
                answer = None
        print(f"capture: {name} {result.how_it_ended} in {result.duration_s:.1f} s; "
              f"answer.txt: {answer!r}")
        if result.exit_code != 0 or answer != "42\n":
            print(f"stdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}")
            return 1
        return 0
    finally:
        await runner.cleanup()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--harness", help="instead of serving: run this catalog harness "
                        "in a sandbox through the episode (installing it if need be)")
    parser.add_argument("--backend", default="bwrap", help="with --harness: the sandbox "
                        "backend (bwrap or docker)")
    parser.add_argument("--image", help="with --harness --backend docker: the image")
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="with --harness: variables over the catalog's (as agent_env)")
    parser.add_argument("--memory-mb", type=int, help="with --harness: the sandbox's memory "
                        "limit (default: the catalog's memory_mb)")
    parser.add_argument("--input-tokens", type=int, default=None,
                        help="input tokens every reply reports (default: 100; Anthropic: "
                             "the body's size / 4)")
    args = parser.parse_args()
    if args.input_tokens is not None:
        USAGE.update(input_tokens=args.input_tokens, forced=args.input_tokens)
    if args.harness:
        raise SystemExit(asyncio.run(run_in_sandbox(
            args.harness, args.out, args.backend, args.image,
            dict(item.split("=", 1) for item in args.env), args.memory_mb)))
    asyncio.run(serve(args.port, args.out))
