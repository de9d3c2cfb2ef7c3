"""vLLM's OpenAI-compatible API server, with its engine core forked rather than spawned on a
CPU. Same arguments as ``python -m vllm.entrypoints.openai.api_server``:

    python -m environments.inference.vllm_serve --model DIR --port 8000 ...

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for every server, so its
engine core process starts a fresh interpreter and imports vLLM and torch again, which the
API server has just done: on 2 cores a tiny model's start took 30-33 s of CPU spawned and
17-20 s forked (benchmarks/vllm_startup.py). Forking is what vLLM does on a GPU wherever
CUDA is not yet initialized; on a CPU the API server has run no torch work before its
engine core starts, so the child inherits no OpenMP state (its worker binds its threads
after the fork, as spawned). Everything else vLLM decides stays as it is: where it must
spawn (inside a Ray actor, with ``--numa-bind``) it still does, and a GPU server is not
touched (the CPU platform's config hook never runs there). ``VLLM_WORKER_MULTIPROC_METHOD``
set to ``spawn`` in the environment keeps vLLM's own choice.
"""

from __future__ import annotations

import os
import runpy
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def fork_engine_core_on_cpu() -> bool:
    """Patch vLLM's CPU platform so that it leaves the start method at ``fork``. False
    (nothing patched, vLLM spawns) where this vLLM has no such hook or the environment
    asks for spawn."""
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
        return False
    try:
        from vllm.platforms.cpu import CpuPlatform
        hook = CpuPlatform.check_and_update_config.__func__
    except (ImportError, AttributeError):
        return False

    def check_and_update_config(cls, vllm_config):
        hook(cls, vllm_config)
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True


def main() -> None:
    fork_engine_core_on_cpu()
    sys.argv[0] = SERVER_MODULE
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
