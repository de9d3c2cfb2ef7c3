"""The quickstart's episodes per second through the env framework, against the engine's
ceiling: the same work through vLLM's offline ``LLM.generate``, in one run.

``--config`` names the run config whose env settings and vLLM settings are measured
(configs/quickstart.yaml by default; configs/smollm2.yaml measures SmolLM2 with its warm
start, vLLM's dtype as the config resolves it: ``auto`` is bfloat16 on a CPU with AMX-BF16
or AVX512-BF16). With the quickstart:

1. **Framework.** One vLLM server (the quickstart's settings: float32, eager,
   ``max_model_len`` 1024, 1 GiB of KV cache) serves the policy (``--model``: the
   quickstart's warm start). The real ``arithmetic_tool`` env, with the quickstart's env
   settings (group size 8, 3 turns, 48 tokens a turn, temperature 1; ``--concurrency``:
   the env's setting, its default unless given), collects ``--groups`` groups through
   the framework (``BaseEnv.process``: the agent loop, the chat template, the tool-call
   parser, the calculator, the turn rewards, the HTTP client and vLLM's API server),
   after one warm-up group. Groups of equal scores are kept (so every episode sampled is
   counted and replayed below). Result: episodes/s.
2. **Engine ceiling.** The server is stopped; in a fresh process, ``vllm.LLM`` loads the
   same model with the same settings, its engine in that process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the faster way on a CPU), and the very turns the
   framework sampled are replayed: for turn k, one ``LLM.generate`` call holds every
   episode's k-th turn, its prompt the episode's recorded context before that turn
   (prompt, earlier turns, tool results) and ``max_tokens`` the number of tokens the
   framework's turn sampled, with ``ignore_eos`` so exactly that many are sampled (same
   temperature, ``logprobs=0`` as the framework asks). Turn k+1 needs turn k's tool
   result, so the turns go in ``max_turns`` batches, the fastest a multi-turn episode can
   go on this engine. One untimed warm-up call first. Result: episodes/s = episodes / the
   summed seconds of those calls.

The script prints both, the ratio framework / ceiling and whether it meets the goal
(>= 0.8); ``--json OUT`` writes them. It also prints the CPU time the server's API server
and engine core took over the framework's groups, with the engine core's busiest threads
(an OpenMP thread that spins shows there); ``--vllm-env KEY=VALUE`` sets the server's
environment (``OMP_NUM_THREADS=2``: its engine at a torch thread per core). Run it alone
(heavy: it starts vLLM twice):

    flock /tmp/lachesis-heavy.lock .venv/bin/python benchmarks/rollout_throughput.py \\
        --model runs/quickstart/warm_start/final --json /tmp/rollout_throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GOAL = 0.8
CONFIG = REPO_ROOT / "configs" / "quickstart.yaml"
"""The run config whose env and vLLM settings are measured (``--config``)."""


def quickstart() -> tuple[dict[str, Any], dict[str, Any]]:
    """The env settings and vLLM settings of :data:`CONFIG` (the quickstart's by
    default)."""
    config = yaml.safe_load(Path(CONFIG).read_text())
    return config["envs"][0]["settings"], config.get("vllm", {})


def vllm_dtype(vllm_settings: dict[str, Any]) -> str:
    """vLLM's dtype in the config (``auto``: bfloat16 on a CPU with AMX-BF16 or
    AVX512-BF16, as ``lachesis run`` resolves it)."""
    from environments.inference.dtypes import resolve_dtype

    return resolve_dtype(vllm_settings.get("dtype", "float32"))


def server_cpu_snapshot(pid: int) -> tuple[float, float, dict[str, float]]:
    """The vLLM server's CPU seconds so far (``pid``: its API server): the whole server,
    its child processes (the engine core), and each thread of those children."""
    from lachesis.run.processes import tree_cpu_seconds

    threads = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _parent(proc) == pid:
            for task in (proc / "task").glob("*"):
                threads[f"{proc.name}/{task.name}"] = _cpu_s(task / "stat")
    return (tree_cpu_seconds(pid), tree_cpu_seconds(pid, include_root=False), threads)


def _stat_fields(stat: Path) -> list[str]:
    return stat.read_text().rsplit(")", 1)[1].split()


def _parent(proc: Path) -> int | None:
    try:
        return int(_stat_fields(proc / "stat")[1])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_s(stat: Path) -> float:
    """User + system CPU seconds of one thread (0 if it is gone)."""
    try:
        fields = _stat_fields(stat)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(before: tuple[float, float, dict[str, float]],
               after: tuple[float, float, dict[str, float]]) -> dict[str, Any]:
    """The API server's and the engine core's CPU seconds between two
    :func:`server_cpu_snapshot`, and the engine core's busiest threads."""
    core = after[1] - before[1]
    busiest = sorted((v - before[2].get(k, 0.0) for k, v in after[2].items()), reverse=True)
    return {"api_server_cpu_s": round(after[0] - before[0] - core, 2),
            "engine_core_cpu_s": round(core, 2),
            "engine_core_busiest_threads_cpu_s": [round(v, 2) for v in busiest[:3]]}


async def framework(model: str, url: str, groups: int, concurrency: int | None,
                    out: Path, share: bool = True, server_pid: int | None = None
                    ) -> dict[str, Any]:
    from environments.envs.arithmetic_tool import ArithmeticToolEnv

    settings, _ = quickstart()
    settings = {k: v for k, v in settings.items() if not k.startswith("eval")}
    # max_queued_groups stays: offline it bounds the groups under way, as in the run
    if concurrency is not None:  # and as many groups under way as that takes
        settings["concurrency"] = concurrency
        settings["max_queued_groups"] = -(-concurrency // settings["group_size"])
    env = ArithmeticToolEnv(ArithmeticToolEnv.config_class.model_validate({
        **settings, "tokenizer": model, "inference_servers": [url],
        "keep_equal_score_groups": True, "seed": 1, "share_identical_requests": share}))
    await env.start()
    try:
        await env.process(out.with_suffix(".warmup.jsonl"), 1)
        before = env.stats.trajectories
        cpu_before = server_cpu_snapshot(server_pid) if server_pid else None
        started, env_cpu = time.monotonic(), time.process_time()
        await env.process(out, groups)
        seconds = time.monotonic() - started
        env_cpu = time.process_time() - env_cpu  # this process: the env and its client
        episodes = env.stats.trajectories - before
        cpu = server_cpu(cpu_before, server_cpu_snapshot(server_pid)) if server_pid else {}
    finally:
        await env.close()
    return {"episodes": episodes, "seconds": seconds, "episodes_per_s": episodes / seconds,
            "concurrency": env.config.rollout_slots(), "groups": groups,
            "failed_groups": env.stats.groups_failed, "env_cpu_s": round(env_cpu, 2), **cpu}


def replay_turns(groups_path: Path) -> list[list[tuple[list[int], int]]]:
    """Per turn index, each episode's ``(context before the turn, tokens it sampled)``."""
    by_turn: list[list[tuple[list[int], int]]] = []
    n = 0
    for line in groups_path.read_text().splitlines():
        for trajectory in json.loads(line)["trajectories"]:
            n += 1
            tokens = trajectory["tokens"]
            for k, (start, end) in enumerate(trajectory["turn_spans"]):
                while len(by_turn) <= k:
                    by_turn.append([])
                by_turn[k].append((tokens[:start], end - start))
    return by_turn


def ceiling(model: str, groups_path: Path, eager: bool = True) -> dict[str, Any]:
    """Runs in its own process (``--ceiling``): the recorded turns through ``LLM.generate``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings, vllm_settings = quickstart()
    llm = LLM(model=model, dtype=vllm_dtype(vllm_settings), enforce_eager=eager,
              max_model_len=vllm_settings.get("max_model_len", 1024),
              gpu_memory_utilization=0.3, seed=0)
    by_turn = replay_turns(groups_path)
    episodes = len(by_turn[0])

    def params(n_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=settings.get("temperature", 1.0),
                              max_tokens=n_tokens, min_tokens=n_tokens, ignore_eos=True,
                              logprobs=0, detokenize=False)  # as the env's client asks

    warm = by_turn[0][:8]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in warm],
                 [params(n) for _, n in warm], use_tqdm=False)
    seconds, sampled = 0.0, 0
    for turns in by_turn:
        started = time.monotonic()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in turns],
                               [params(n) for _, n in turns], use_tqdm=False)
        seconds += time.monotonic() - started
        got = [len(o.outputs[0].token_ids) for o in outputs]
        if got != [n for _, n in turns]:
            raise RuntimeError("the replay did not sample the recorded number of tokens")
        sampled += sum(got)
    return {"episodes": episodes, "seconds": seconds, "episodes_per_s": episodes / seconds,
            "turn_batches": [len(t) for t in by_turn], "sampled_tokens": sampled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None,
                        help="the run config whose env settings and vLLM settings (dtype, "
                        "max_model_len, KV cache) are measured (default "
                        "configs/quickstart.yaml)")
    parser.add_argument("--model", default=None,
                        help="the policy (default: the config's warm start, "
                        "runs/NAME/warm_start/final: the quickstart's after `make demo`)")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="rollouts in flight, with as many groups under way as that "
                        "takes (default: the quickstart's, a batch: 64)")
    parser.add_argument("--unshared", action="store_true",
                        help="also run the framework with share_identical_requests off "
                        "(one request per rollout's first turn), after the default")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable of the framework's vLLM server "
                        "(repeatable), e.g. OMP_NUM_THREADS=2")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                        help="an argument of the framework's vLLM server (repeatable; "
                        "`--vllm-arg=--max-num-seqs=256`)")
    parser.add_argument("--compiled", action="store_true",
                        help="both engines without --enforce-eager (vLLM compiles the model "
                        "with torch.compile at start)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--ceiling", help=argparse.SUPPRESS)  # internal: GROUPS.jsonl
    args = parser.parse_args()
    global CONFIG
    if args.config is not None:
        CONFIG = Path(args.config) if Path(args.config).exists() else REPO_ROOT / args.config
        CONFIG = CONFIG.resolve()
    if args.model is None:
        name = yaml.safe_load(Path(CONFIG).read_text()).get("name", "quickstart")
        args.model = f"runs/{name}/warm_start/final"
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    if not Path(model, "config.json").exists():
        sys.exit(f"--model {args.model}: no HF model there (run `make demo` first)")
    if args.ceiling:
        print("CEILING " + json.dumps(ceiling(model, Path(args.ceiling), not args.compiled)),
              flush=True)
        return

    from environments.inference.vllm_process import VLLMProcess

    _, vllm_settings = quickstart()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-throughput-"))
    groups_path = workdir / "groups.jsonl"
    with VLLMProcess(model, max_model_len=vllm_settings.get("max_model_len", 1024),
                     dtype=vllm_dtype(vllm_settings),
                     kv_cache_space_gib=vllm_settings.get("kv_cache_gib", 1),
                     env=dict(kv.split("=", 1) for kv in args.vllm_env),
                     enforce_eager=not args.compiled, extra_args=args.vllm_arg,
                     log_path=workdir / "vllm.log") as server:
        side = asyncio.run(framework(model, server.url, args.groups, args.concurrency,
                                     groups_path, server_pid=server.proc.pid))
        print(f"framework: {side['episodes']} episodes in {side['seconds']:.2f} s = "
              f"{side['episodes_per_s']:.1f} episodes/s (concurrency {side['concurrency']})",
              flush=True)
        print(f"  CPU meanwhile: the env {side['env_cpu_s']} s, vLLM's API server "
              f"{side['api_server_cpu_s']} s, its engine core {side['engine_core_cpu_s']} s "
              f"(busiest threads {side['engine_core_busiest_threads_cpu_s']})", flush=True)
        unshared = None
        if args.unshared:
            unshared = asyncio.run(framework(model, server.url, args.groups, args.concurrency,
                                             workdir / "unshared.jsonl", share=False))
            print(f"framework, share_identical_requests off: {unshared['episodes']} episodes "
                  f"in {unshared['seconds']:.2f} s = {unshared['episodes_per_s']:.1f} "
                  "episodes/s", flush=True)
    # The engine in the script's own process, its worker inside it (no process hop): the
    # fastest way vLLM CPU runs here (a separate engine core and worker, vLLM's default
    # for LLM, sampled these turns 1.1-1.8x slower); torch's threads as vLLM leaves them
    # (one per core: alone on the machine, 1 or 2 threads sampled as fast here).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(vllm_settings.get("kv_cache_gib", 1)),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, __file__, "--model", model, "--config", str(CONFIG),
                           "--ceiling", str(groups_path)]
                          + (["--compiled"] if args.compiled else []), env=env,
                          capture_output=True, text=True, timeout=1800)
    line = next((x for x in done.stdout.splitlines() if x.startswith("CEILING ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"the engine-ceiling run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    top = json.loads(line.removeprefix("CEILING "))
    ratio = side["episodes_per_s"] / top["episodes_per_s"]
    print(f"engine ceiling (LLM.generate, {len(top['turn_batches'])} turn batches of "
          f"{top['turn_batches']}): {top['episodes']} episodes in {top['seconds']:.2f} s = "
          f"{top['episodes_per_s']:.1f} episodes/s")
    print(f"({Path(CONFIG).name}, vLLM {vllm_dtype(vllm_settings)})")
    print(f"framework / ceiling = {ratio:.2f} (goal >= {GOAL}: "
          f"{'met' if ratio >= GOAL else 'NOT met'})")
    if unshared is not None:
        print(f"framework, share_identical_requests off / ceiling = "
              f"{unshared['episodes_per_s'] / top['episodes_per_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": str(CONFIG),
                                               "dtype": vllm_dtype(vllm_settings),
                                               "framework": side, "ceiling": top,
                                               "ratio": ratio, "goal": GOAL,
                                               "framework_unshared": unshared}, indent=1))


if __name__ == "__main__":
    main()
