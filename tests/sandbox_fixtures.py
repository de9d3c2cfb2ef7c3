"""Fixtures and helpers of the sandbox tests: a docker daemon and image, a scripted model.

`docker_image` starts dockerd when none answers (as DESIGN.md says: no iptables, vfs, no
bridge) and builds the sandbox image with debootstrap when its tag is missing (about a
minute, once: the image stays in the daemon's data root), then yields the tag. The docker
tests must run in CI; they fail (not skip) when docker cannot be had, unless
LACHESIS_SKIP_DOCKER_TESTS=1 is set on purpose.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from environments.rollout import GeneratedTurn, Rollout


@pytest.fixture(scope="session")
def docker_image(tmp_path_factory):
    if os.environ.get("LACHESIS_SKIP_DOCKER_TESTS") == "1":
        pytest.skip("LACHESIS_SKIP_DOCKER_TESTS=1")
    from environments.sandbox.images import ensure_dockerd, ensure_image, stop_dockerd

    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    proc = ensure_dockerd(log_path=log)
    try:
        yield ensure_image()
    finally:
        stop_dockerd(proc)


def tool_call(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class ScriptedBackend:
    """A "model" that plays a script: ``script(state, turn_index) -> text`` or a list of
    texts (one per turn). Token ids come from the tiny byte-level tokenizer, so the
    trajectory is as real as with vLLM, minus the sampling."""

    trainable = True

    def __init__(self, renderer, script: Callable[[Rollout, int], str] | list[str]):
        self.renderer = renderer
        self.script = script

    async def generate(self, state: Rollout, max_tokens: int) -> GeneratedTurn:
        turn = len(state.turns)
        if callable(self.script):
            text = self.script(state, turn)
        else:
            text = self.script[min(turn, len(self.script) - 1)]
        ids = self.renderer.encode(text)[:max(0, max_tokens - 1)]
        ids.append(self.renderer.tokenizer.eos_token_id)
        return GeneratedTurn(ids, [-0.5] * len(ids), text, "stop", True)


_RENDERER = None


def scripted(env, script) -> Any:
    """``env`` wired to a ScriptedBackend (no inference server); returns ``env``."""
    global _RENDERER
    from environments.inference.chat_template import ChatRenderer
    from lachesis.tiny_model import build_tokenizer

    if _RENDERER is None:
        _RENDERER = ChatRenderer(build_tokenizer())
    env.renderer = _RENDERER
    env.backend = env.eval_backend = ScriptedBackend(_RENDERER, script)
    return env


def host_processes_mentioning(text: str) -> list[str]:
    """Command lines of host processes that contain ``text``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and "pytest" not in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found
