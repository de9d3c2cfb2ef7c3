"""Sandbox latency (create + exec + destroy, per backend) and gsm8k_code rollouts/s.

1. Latency: ``--iterations`` times, one after the other: create a sandbox, run
   ``python3 -c 'print(6 * 7)'`` in it, close it; p50 / p95 of each phase and of the
   total, per backend (``bwrap``, ``docker``). Then 8 sandboxes at once (a group): the
   wall time of create + exec + close for all 8.
2. Rollouts/s of ``gsm8k_code`` (``dataset: sample``, groups of 8, every rollout in its
   own sandbox) through the framework (``BaseEnv.process`` -> JSONL):
   * ``tiny-model``: the random tiny model on a vLLM CPU server (started here unless
     ``--vllm-url``); it rarely writes a valid tool call, so this is mostly sandbox
     create/close around sampling;
   * ``scripted``: a scripted policy (the reference code through the ``python`` tool,
     then the answer): every rollout runs code in its sandbox; no model.

3. Grading latency (``--grading``): ``code_debug`` grading the canonical fix of each sample
   task and ``swe_fix`` grading the gold fix of each sample repository (bwrap),
   ``--iterations`` rounds; p50 / p95 per grading. ``--grading-baseline REF`` measures the
   same in the tree of git ``REF`` (extracted with ``git archive``; this script is copied
   into it) and in this one, alternating rounds in subprocesses so that both see the same
   machine load, and prints the ratio (this tree / REF)::

       .venv/bin/python benchmarks/sandbox_latency.py --grading --grading-baseline main

Docker is started (``dockerd``) when no daemon answers, and the image is built when it
is missing (see environments/sandbox/images.py). Run from the repo root:

    .venv/bin/python benchmarks/sandbox_latency.py
    .venv/bin/python benchmarks/sandbox_latency.py --backends bwrap --iterations 100 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from environments.envs.gsm8k_code import GSM8KCodeConfig, GSM8KCodeEnv  # noqa: E402
from environments.framework.agent_loop import GeneratedTurn  # noqa: E402
from environments.sandbox import SandboxConfig, create_sandbox  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(values, 50) * 1000, 1),
            "p95_ms": round(percentile(values, 95) * 1000, 1),
            "mean_ms": round(statistics.mean(values) * 1000, 1)}


async def one_cycle(config: SandboxConfig) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    box = await create_sandbox(config)
    t1 = time.perf_counter()
    result = await box.exec(["python3", "-c", "print(6 * 7)"])
    t2 = time.perf_counter()
    await box.close()
    t3 = time.perf_counter()
    if result.stdout != "42\n":
        raise RuntimeError(f"unexpected result {result}")
    return t1 - t0, t2 - t1, t3 - t2


async def latency(backend: str, iterations: int, image: str | None) -> dict[str, Any]:
    config = SandboxConfig(backend=backend, image=image)
    await one_cycle(config)  # warm-up (page cache, image layers, first-use probe)
    phases = [await one_cycle(config) for _ in range(iterations)]
    started = time.perf_counter()
    await asyncio.gather(*(one_cycle(config) for _ in range(8)))
    group = time.perf_counter() - started
    return {"backend": backend, "iterations": iterations,
            "create": summary([p[0] for p in phases]), "exec": summary([p[1] for p in phases]),
            "destroy": summary([p[2] for p in phases]),
            "total": summary([sum(p) for p in phases]),
            "group_of_8_wall_s": round(group, 2)}


class ScriptedPolicy:
    """Plays the reference solution: the python tool with the item's code, then the answer."""

    trainable = True

    def __init__(self, renderer, items_by_question: dict[str, dict]):
        self.renderer = renderer
        self.items = items_by_question

    async def generate(self, state, max_tokens: int) -> GeneratedTurn:
        item = self.items[state.messages[1]["content"]]
        if not state.turns:
            call = {"name": "python", "arguments": {"code": item["solution_code"]}}
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:
            text = f"<answer>{item['answer']}</answer>"
        ids = self.renderer.encode(text) + [self.renderer.tokenizer.eos_token_id]
        return GeneratedTurn(ids, [-0.5] * len(ids), text, "stop", True)


async def rollouts(mode: str, backend: str, groups: int, image: str | None,
                   vllm_url: str | None, model_dir: Path | None) -> dict[str, Any]:
    settings = dict(dataset="sample", group_size=8, max_turns=2, max_tokens_per_turn=64,
                    keep_equal_score_groups=True, concurrency=16, sandbox_backend=backend,
                    sandbox_image=image, seed=0)
    if mode == "tiny-model":
        settings.update(tokenizer=str(model_dir), inference_servers=[vllm_url])
    env = GSM8KCodeEnv(GSM8KCodeConfig(**settings))
    if mode == "tiny-model":
        await env.start()
    else:
        from environments.inference.chat_template import ChatRenderer
        from lachesis.tiny_model import build_tokenizer

        env.renderer = ChatRenderer(build_tokenizer())
        await env.setup()
        env.backend = ScriptedPolicy(env.renderer, {i["question"]: i for i in env.train})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            stats = await env.process(Path(tmp) / "out.jsonl", groups)
    finally:
        await env.close()
    return {"mode": mode, "backend": backend, "groups": stats["groups_sent"],
            "trajectories": stats["trajectories"], "seconds": stats["seconds"],
            "rollouts_per_s": round(stats["trajectories"] / stats["seconds"], 2),
            "tool_calls": stats["tool_calls"], "groups_failed": stats["groups_failed"],
            "sandbox": stats["sandbox"]}


async def grading_latency(iterations: int) -> dict[str, Any]:
    """Seconds per grading: code_debug (canonical fixes), swe_fix (gold fixes)."""
    from environments.envs.code_debug import CodeDebugConfig, CodeDebugEnv
    from environments.envs.code_debug import load_sample as code_tasks
    from environments.envs.swe_fix import SweFixConfig, SweFixEnv, make_tar
    from environments.envs.swe_fix import load_sample as swe_tasks

    code_env = CodeDebugEnv(CodeDebugConfig(dataset="sample"))
    swe_env = SweFixEnv(SweFixConfig(dataset="sample"))
    times: dict[str, list[float]] = {"code_debug": [], "swe_fix": []}
    for _ in range(iterations):
        for task in code_tasks():
            started = time.perf_counter()
            passed = await code_env.grade(task, task["prompt"] + task["canonical_solution"])
            times["code_debug"].append(time.perf_counter() - started)
            if not passed:
                raise RuntimeError(f"the canonical fix of {task['entry_point']} failed")
        for item in swe_tasks():
            tar = make_tar(item["fixed_files"])
            started = time.perf_counter()
            grading = await swe_env.grade(item, tar)
            times["swe_fix"].append(time.perf_counter() - started)
            if not grading.resolved:
                raise RuntimeError(f"the gold fix of {item['id']} failed: {grading}")
    return {name: values for name, values in times.items()}


def grading_comparison(ref: str, iterations: int, rounds: int) -> dict[str, Any]:
    """Grading latency in git ``ref``'s tree and in this one, alternating rounds."""
    import shutil
    import subprocess

    here = Path(__file__).resolve().parent.parent
    base = Path(tempfile.mkdtemp(prefix="lachesis-baseline-"))
    try:
        archive = subprocess.run(["git", "-C", str(here), "archive", ref], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        shutil.copy(__file__, base / "benchmarks" / "sandbox_latency.py")
        samples: dict[str, dict[str, list[float]]] = {"baseline": {}, "this": {}}
        for _ in range(rounds):
            for label, tree in (("baseline", base), ("this", here)):
                out = base / f"{label}.json"
                subprocess.run([sys.executable, str(tree / "benchmarks" / "sandbox_latency.py"),
                                "--grading-only", "--iterations", str(iterations),
                                "--json", str(out)], cwd=tree, check=True)
                for name, values in json.loads(out.read_text()).items():
                    samples[label].setdefault(name, []).extend(values)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = {}
    for name in samples["this"]:
        before, after = summary(samples["baseline"][name]), summary(samples["this"][name])
        rows[name] = {"baseline": before, "this": after,
                      "ratio_p50": round(after["p50_ms"] / before["p50_ms"], 2),
                      "ratio_mean": round(after["mean_ms"] / before["mean_ms"], 2)}
    return {"ref": ref, "rounds": rounds, "iterations": iterations, "grading": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="bwrap,docker")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--groups", type=int, default=4, help="gsm8k_code groups of 8 per run")
    parser.add_argument("--rollout-modes", default="tiny-model,scripted")
    parser.add_argument("--vllm-url", default=None, help="use this server (serving --model-dir)")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--grading", action="store_true",
                        help="measure grading latency instead (code_debug, swe_fix; bwrap)")
    parser.add_argument("--grading-baseline", default=None, metavar="REF",
                        help="with --grading: also measure git REF's tree, print the ratio")
    parser.add_argument("--rounds", type=int, default=3, help="--grading-baseline rounds")
    parser.add_argument("--grading-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.grading_only:  # one side of --grading-baseline: raw seconds to --json
        args.json.write_text(json.dumps(asyncio.run(grading_latency(args.iterations))))
        return 0
    if args.grading:
        if args.grading_baseline:
            result = grading_comparison(args.grading_baseline, args.iterations, args.rounds)
            for name, row in result["grading"].items():
                print(f"{name:10s} grading p50 {row['baseline']['p50_ms']:7.1f} ms "
                      f"({args.grading_baseline}) -> {row['this']['p50_ms']:7.1f} ms (this tree)"
                      f"  ratio p50 {row['ratio_p50']:.2f}  mean {row['ratio_mean']:.2f}",
                      flush=True)
        else:
            times = asyncio.run(grading_latency(args.iterations))
            result = {name: summary(values) for name, values in times.items()}
            for name, row in result.items():
                print(f"{name:10s} grading p50 {row['p50_ms']:7.1f} ms  p95 {row['p95_ms']:7.1f} "
                      f"ms", flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
    backends = [b for b in args.backends.split(",") if b]
    modes = [m for m in args.rollout_modes.split(",") if m]

    image = dockerd = None
    if "docker" in backends:
        from environments.sandbox.images import ensure_dockerd, ensure_image

        dockerd = ensure_dockerd()
        image = ensure_image()
    server = None
    results: dict[str, Any] = {"latency": [], "rollouts": []}
    try:
        for backend in backends:
            row = asyncio.run(latency(backend, args.iterations, image))
            results["latency"].append(row)
            print(f"{backend:7s} create p50 {row['create']['p50_ms']:8.1f} ms  "
                  f"exec p50 {row['exec']['p50_ms']:7.1f} ms  destroy p50 "
                  f"{row['destroy']['p50_ms']:7.1f} ms  | total p50 {row['total']['p50_ms']:8.1f}"
                  f" ms  p95 {row['total']['p95_ms']:8.1f} ms  | 8 at once "
                  f"{row['group_of_8_wall_s']:.2f} s", flush=True)
        vllm_url, model_dir = args.vllm_url, args.model_dir
        if "tiny-model" in modes and vllm_url is None:
            from environments.inference.vllm_process import VLLMProcess
            from lachesis.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
            server = VLLMProcess(model_dir, served_model_name="tiny", max_model_len=4096)
            server.start()
            server.wait_ready(timeout=300)
            vllm_url = server.url
        for mode in modes:
            for backend in backends:
                row = asyncio.run(rollouts(mode, backend, args.groups, image, vllm_url,
                                           model_dir))
                results["rollouts"].append(row)
                print(f"gsm8k_code {mode:10s} {backend:7s} {row['trajectories']:3d} rollouts in "
                      f"{row['seconds']:6.2f} s = {row['rollouts_per_s']:6.2f} rollouts/s "
                      f"(tool calls {row['tool_calls']}, failed groups "
                      f"{row['groups_failed']})", flush=True)
    finally:
        if server is not None:
            server.stop()
        if dockerd is not None:
            from environments.sandbox.images import stop_dockerd

            stop_dockerd(dockerd)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
