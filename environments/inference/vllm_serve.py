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

Where the worker runs inside the engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which
``VLLMProcess`` sets), it gets every core but one for its torch threads, as vLLM gives its
own worker process (:func:`leave_a_core_to_the_scheduler`). With the model eager
(``--enforce-eager``, what every Lachesis server on a CPU runs), vLLM's few compiled helpers
run eagerly too, instead of compiling at the first request for logprobs
(:func:`run_compiled_helpers_eagerly`).
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
        from vllm.config import CompilationMode
        from vllm.platforms.cpu import CpuPlatform
        hook = CpuPlatform.check_and_update_config.__func__
    except (ImportError, AttributeError):
        return False

    def check_and_update_config(cls, vllm_config):
        hook(cls, vllm_config)
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        if vllm_config.parallel_config.distributed_executor_backend == "uni":
            leave_a_core_to_the_scheduler()
        if vllm_config.compilation_config.mode == CompilationMode.NONE:  # the model eager
            run_compiled_helpers_eagerly()

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True


def leave_a_core_to_the_scheduler() -> None:
    """The worker inside the engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what
    :class:`~environments.inference.vllm_process.VLLMProcess` starts on a CPU) gets the
    threads vLLM's own worker process would: every core but one, which its scheduler keeps
    (vLLM binds them only in a worker process of its own, and its CPU worker then refuses
    to lower torch's threads, so they stayed at one per core). With a thread per core, the
    engine's OpenMP threads spin on the core the scheduler, the API server and the env
    need: on 2 cores the engine core took 1.6-1.7 cores to serve the quickstart's rollouts.
    ``OMP_NUM_THREADS`` in the environment keeps its own count."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    threads = worker_threads()
    torch.set_num_threads(threads)
    print(f"lachesis: the engine's worker runs {threads} torch thread(s): every core but one "
          "(OMP_NUM_THREADS sets another count)", file=sys.stderr, flush=True)


def run_compiled_helpers_eagerly() -> bool:
    """With the model eager (``--enforce-eager``: vLLM compiles no model), vLLM still wraps
    a few helpers in ``torch.compile``, with inductor on a CPU: the first request that asks
    for logprobs (every rollout's does) compiled the sampler's count of a token's rank, in
    every server started: 8-10 s of CPU with inductor's cache empty (a new machine), 1-3 s
    with it (benchmarks/vllm_startup.py, docs/benchmarks-vllm-startup.md). Eager, that count takes
    about as long on a CPU (0.02-0.18 ms against 0.07-0.13 ms for 8-256 rows of 405
    logits). Dynamo off in this process, and in any vLLM spawns from it
    (``TORCHDYNAMO_DISABLE``; the engine core forked from it inherits the setting).
    ``TORCHDYNAMO_DISABLE`` set in the environment keeps its own value: ``0`` keeps
    vLLM's compiled helpers."""
    if "TORCHDYNAMO_DISABLE" in os.environ:
        return False
    import torch._dynamo

    torch._dynamo.config.disable = True
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    return True


def worker_threads() -> int:
    """Every core but one, at least one."""
    return max(1, (os.cpu_count() or 1) - 1)


def main() -> None:
    fork_engine_core_on_cpu()
    sys.argv[0] = SERVER_MODULE
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
