"""The quickstart's RL step time, with variants side by side, and where the CPU goes.

Each variant is a short ``lachesis run`` of configs/quickstart.yaml's RL phase (the real
processes: rollout API, vLLM, env server, trainer), started from an existing policy
(``--model``: the quickstart's warm start, ``runs/quickstart/warm_start/final`` after
``make demo``), without evaluation, for ``--steps`` steps. The variants run one after the
other in this one invocation (``--repeats`` rounds, alternating), so they share the
machine's state; the script prints, per variant:

- the median seconds per RL step (the trainer's ``time/step``, steps after
  ``--skip`` warm-up steps) and completions per second, and each variant's ratio to the
  first given;
- the mean seconds of one rollout (generation, env work, waiting for a slot) and of one
  turn as the env saw it (``generation / turns``), against vLLM's own account of a
  request (its ``/metrics`` histograms over the same steps: queue, prefill, decode,
  end to end): the difference is the HTTP client, vLLM's API server and the env's
  event loop;
- vLLM's mean running and waiting requests (its gauges sampled every 2 s) and its
  prefix-cache hit rate;
- the CPU each process used over the timed steps (``/proc/PID/stat``, in cores).

Variants (``--variants``, comma-separated): ``base`` is the configuration as the
quickstart has it now; ``before`` restores the defaults before issue 44 (16 rollouts in
flight, the trainer at torch's default of a thread per core: ``OMP_NUM_THREADS=2`` on 2
cores, set for the whole run as torch would), the others change one thing (see
``VARIANTS``). ``--checkout NAME=DIR`` adds a variant ``NAME``: ``base``'s settings run
by another checkout's code (e.g. ``git worktree add /tmp/before main``), to measure a
change of code side by side. Every run starts from ``--workdir`` with only its variant's
checkout on the ``PYTHONPATH``. ``--json OUT`` writes everything.

    .venv/bin/python benchmarks/rl_step_time.py --model runs/quickstart/warm_start/final \\
        --steps 12 --variants before,base --json /tmp/steps.json

``--config CONFIG`` measures another run config's RL phase (configs/quickstart.yaml by
default; ``--model`` defaults to its warm start, runs/NAME/warm_start/final).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from environments.inference.vllm_process import free_port  # noqa: E402
from environments.inference.vllm_serve import worker_threads  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")

VARIANTS: dict[str, dict[str, Any]] = {
    # each: env settings, trainer settings, vLLM args, vLLM's environment and the run's
    # environment on top of the quickstart's
    "base": {},
    # before issue 44: 16 rollouts in flight, torch's default threads (one per core, 2 here)
    "before": {"env": {"concurrency": 16}, "environment": {"OMP_NUM_THREADS": "2"}},
    "c16": {"env": {"concurrency": 16}},
    "omp2": {"environment": {"OMP_NUM_THREADS": "2"}},
    "block32": {"vllm_args": ["--block-size", "32"]},
    "c64": {"env": {"concurrency": 64}},
    "c64-block32": {"env": {"concurrency": 64}, "vllm_args": ["--block-size", "32"]},
    "c64-omp1": {"env": {"concurrency": 64}, "environment": {"OMP_NUM_THREADS": "1"}},
    # the trainer's poll for its next batch before it became 0.05 s
    "poll0.5": {"train": {"lease_poll_s": 0.5, "lease_wait_s": 0}},
    # a request per rollout's first turn, instead of one per group (n = group size)
    "unshared": {"env": {"share_identical_requests": False}},
    # the frozen requests keep the old weights' keys/values across a sync
    "stale-kv": {"train": {"sync_stale_kv": True}},
    # two batches of groups ahead of the trainer instead of one (within max_staleness 2)
    "ahead2": {"env": {"max_queued_groups": 16}},
    "ahead2-stale-kv": {"env": {"max_queued_groups": 16}, "train": {"sync_stale_kv": True}},
    # lockstep: the env samples a batch's groups, then waits for the trainer's sync before
    # the next ones (on-policy; the update runs while vLLM is idle)
    "lockstep": {"env": {"groups_per_policy_version": 8}},
    "lockstep-trainer-threads-per-core": {
        "env": {"groups_per_policy_version": 8},
        "environment": {"OMP_NUM_THREADS": str(os.cpu_count() or 1)},
        "vllm_env": {"OMP_NUM_THREADS": str(worker_threads())}},
    # vLLM compiles the model (torch.compile, inductor) instead of running it eagerly
    "compiled": {"vllm_args": ["--no-enforce-eager"]},
    # vLLM's engine at a torch thread per core, as before its server left a core free
    "vllm-threads-per-core": {"vllm_env": {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}},
    # the trainer at a thread per core, vLLM's engine left as its server sets it
    "trainer-threads-per-core": {"environment": {"OMP_NUM_THREADS": str(os.cpu_count() or 1)},
                                 "vllm_env": {"OMP_NUM_THREADS": str(worker_threads())}},
}


DEFAULT_CONFIG = REPO_ROOT / "configs" / "quickstart.yaml"


def quickstart_config(path: str | Path | None = None) -> dict[str, Any]:
    """A run config as a dict: ``path`` (relative to the working directory, else to the
    repository), configs/quickstart.yaml by default."""
    if path is None:
        path = DEFAULT_CONFIG
    path = Path(path)
    if not path.exists() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    return yaml.safe_load(path.read_text())


def run_config(model: str, name: str, steps: int, variant: dict[str, Any],
               vllm_port: int, config_path: str | Path | None = None) -> dict[str, Any]:
    """``config_path``'s RL phase (configs/quickstart.yaml by default) from ``model``, as
    ``name``, for ``steps`` steps, with ``variant``'s changes and vLLM on ``vllm_port``
    (no warm start, no evaluation, no checkpoint before the end)."""
    config = quickstart_config(config_path)
    config.pop("build_tiny_model", None)
    config.pop("warm_start", None)
    config.update(name=name, model=str(Path(model).resolve()), evaluate=False)
    config["train"] = {**config["train"], **variant.get("train", {}), "steps": steps,
                       "checkpoint_every": 10_000}
    config["vllm"] = {**config.get("vllm", {}), "port": vllm_port,
                      "args": [*config.get("vllm", {}).get("args", []),
                               *variant.get("vllm_args", [])],
                      "environment": {**config.get("vllm", {}).get("environment", {}),
                                      **variant.get("vllm_env", {})}}
    env = config["envs"][0]
    env["settings"] = {**env.get("settings", {}), **variant.get("env", {})}
    return config


LABELS = [  # (a part of the process's comm or command line, which, its label), first match
    ("EngineCor", "comm", "vllm engine core"), ("Worker", "comm", "vllm worker"),
    ("vllm.entrypoints", "cmd", "vllm API server"),
    ("environments.inference.vllm_serve", "cmd", "vllm API server"),
    ("lachesis.cli api", "cmd", "rollout API"),
    ("lachesis.cli env serve", "cmd", "env server"), ("lachesis.cli train", "cmd", "trainer"),
    ("torch.distributed.run", "cmd", "trainer"),
    ("lachesis.cli run", "cmd", "lachesis run (supervisor)")]


def _label(pid: int) -> str | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    for part, where, label in LABELS:
        if part in (comm if where == "comm" else cmd):
            return label
    return f"other ({comm})"


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _cpu_seconds(pid: int) -> float | None:
    """User + system seconds of ``pid``, its threads included."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _metrics_text(url: str, token: str) -> str | None:
    request = urllib.request.Request(url + "/metrics",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus samples, summed over labels (``name`` -> value)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match and 'le="' not in (match.group(2) or ""):
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
    return values


def _steps(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def measure(name: str, variant: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    run_name = f"bench-steps-{name}"
    port = free_port()
    config = run_config(args.model, run_name, args.steps, variant, port, args.config)
    config_path = Path(args.workdir) / f"{run_name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    token = secrets.token_urlsafe(24)
    # from the workdir, not a checkout (``python -m`` puts the directory it starts in first
    # on the path): the variant's code is the one its PYTHONPATH names
    cwd = Path(args.workdir).resolve()
    environment = {**os.environ, "LACHESIS_API_TOKEN": token,
                   "PYTHONPATH": variant.get("checkout", str(REPO_ROOT)),
                   **variant.get("environment", {})}
    run_dir = cwd / "runs" / run_name
    metrics_path = run_dir / "trainer" / "metrics.jsonl"
    log_path = Path(args.workdir) / f"{run_name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lachesis.cli", "run",
                                 str(config_path.resolve()), "--fresh"], env=environment,
                                cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    window: dict[str, Any] = {}
    spies: list[subprocess.Popen] = []
    gauges: list[tuple[float, float]] = []
    started = time.monotonic()
    polls = 0
    labels: dict[int, str] = {}
    cpu_last: dict[int, float] = {}

    def sample_cpu() -> None:
        for pid in _descendants(proc.pid):
            if pid not in labels or labels[pid].startswith("other"):  # vLLM renames its
                label = _label(pid)  # processes once they run
                if label is None:
                    continue
                labels[pid] = label
            seconds = _cpu_seconds(pid)
            if seconds is not None:
                cpu_last[pid] = seconds

    def cpu_by_label() -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, seconds in cpu_last.items():
            out[labels[pid]] = out.get(labels[pid], 0.0) + seconds
        return out

    try:
        while proc.poll() is None:
            if time.monotonic() - started > args.timeout:
                raise TimeoutError(f"{run_name} ran past {args.timeout} s (log: {log_path})")
            sample_cpu()
            done = len(_steps(metrics_path))
            if "start" not in window and done >= args.skip:
                text = _metrics_text(url, token)
                if text is not None:
                    window["start"] = (time.monotonic(), cpu_by_label(),
                                       parse_metrics(text), done)
                    if args.py_spy:
                        spies = start_py_spy(args, run_name, labels)
            if "start" in window and done < args.steps and polls % 4 == 0:
                text = _metrics_text(url, token)
                if text is not None:
                    values = parse_metrics(text)
                    gauges.append((values.get("vllm:num_requests_running", 0.0),
                                   values.get("vllm:num_requests_waiting", 0.0)))
                    if done > window["start"][3]:
                        window["end"] = (time.monotonic(), cpu_by_label(), values, done)
            polls += 1
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    for spy in spies:
        spy.wait(30)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_name} exited with {proc.returncode} (log: {log_path})")
    steps = _steps(metrics_path)
    timed = [s for s in steps if s["step"] > args.skip]
    if not timed or "end" not in window:
        raise RuntimeError(f"{run_name}: no timed steps (log: {log_path})")
    t0, cpu0, m0, done0 = window["start"]
    t1, cpu1, m1, done1 = window["end"]
    wall = t1 - t0

    def delta(key: str) -> float:  # a counter is exported as NAME or NAME_total
        for name in (key, key + "_total"):
            if name in m1:
                return m1[name] - m0.get(name, 0.0)
        return 0.0

    def mean_of(histogram: str) -> float | None:
        count = delta(f"vllm:{histogram}_count")
        return delta(f"vllm:{histogram}_sum") / count if count else None

    trajectories = turns = 0
    for line in (run_dir / "trajectories" / "arithmetic_tool.jsonl").read_text().splitlines():
        for trajectory in json.loads(line).get("trajectories", []):
            trajectories += 1
            turns += len(trajectory.get("turn_spans") or [])
    turns_per_rollout = turns / trajectories if trajectories else None
    step_s = [s["time/step"] for s in timed]
    generation = statistics.mean(s.get("env/time/generation", 0.0) for s in timed)
    queries = delta("vllm:prefix_cache_queries")
    return {
        "variant": name, "settings": variant, "steps": len(timed),
        "median_step_s": statistics.median(step_s),
        "mean_step_s": statistics.mean(step_s),  # stalls show here, not in the median
        "max_step_s": max(step_s),
        "median_batch_wait_s": statistics.median(s["time/batch_wait"] for s in timed),
        "median_train_s": statistics.median(s["time/train"] for s in timed),
        "median_sync_s": statistics.median(s["time/sync"] for s in timed),
        "median_prepare_s": statistics.median(s["time/prepare"] for s in timed),
        "completions_per_s": sum(s["rows"] for s in timed) / sum(step_s),
        "reward_mean": statistics.mean(s["reward_mean"] for s in timed),
        "rollout_generation_s": generation,
        "rollout_env_s": statistics.mean(s.get("env/time/env", 0.0) for s in timed),
        "rollout_queue_wait_s": statistics.mean(s.get("env/time/queue_wait", 0.0)
                                                for s in timed),
        "turns_per_rollout": turns_per_rollout,
        "turn_s_env_side": generation / turns_per_rollout if turns_per_rollout else None,
        "vllm_requests": delta("vllm:request_success"),
        "vllm_request_s": {k: mean_of(h) for k, h in (
            ("end_to_end", "e2e_request_latency_seconds"),
            ("queue", "request_queue_time_seconds"),
            ("prefill", "request_prefill_time_seconds"),
            ("decode", "request_decode_time_seconds"),
            ("first_token", "time_to_first_token_seconds"))},
        "vllm_running_mean": statistics.mean(g[0] for g in gauges) if gauges else None,
        "vllm_waiting_mean": statistics.mean(g[1] for g in gauges) if gauges else None,
        "prefix_cache_hit_rate": delta("vllm:prefix_cache_hits") / queries if queries else None,
        "window_s": wall, "window_steps": done1 - done0,
        "cpu_cores": {label: round((cpu1.get(label, 0.0) - cpu0.get(label, 0.0)) / wall, 3)
                      for label in sorted(cpu1)},
        "log": str(log_path),
    }


PROFILED = ("env server", "vllm API server", "vllm engine core", "vllm worker", "rollout API",
            "trainer")


def start_py_spy(args: argparse.Namespace, run_name: str,
                 labels: dict[int, str]) -> list[subprocess.Popen]:
    """``py-spy record`` (raw collapsed stacks, ``--duration`` s) of each profiled process."""
    spies = []
    for pid, label in labels.items():
        if label in PROFILED:
            out = Path(args.workdir) / f"{run_name}-{label.replace(' ', '_')}-{pid}.txt"
            spies.append(subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "50",
                 "--duration", str(args.py_spy_seconds), "--nonblocking", "-o", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def add_run_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """``--config``, ``--model``, ``--steps`` and ``--skip``: the short RL runs of a
    benchmark (:func:`resolve_run_arguments` fills ``--model``'s default in)."""
    parser.add_argument("--config", default=None,
                        help="the run config whose RL phase runs (default "
                        "configs/quickstart.yaml)")
    parser.add_argument("--model", default=None,
                        help="the policy to start RL from (default: the config's warm start, "
                        "runs/NAME/warm_start/final; the quickstart's: "
                        "runs/quickstart/warm_start/final)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--skip", type=int, default=2,
                        help="warm-up steps left out of the timing")


def resolve_run_arguments(args: argparse.Namespace) -> None:
    """``--model`` by default: the warm start that ``lachesis run --config`` writes,
    runs/NAME/warm_start/final (NAME: the config's ``name``)."""
    if args.model is None:
        name = quickstart_config(args.config).get("name", "quickstart")
        args.model = f"runs/{name}/warm_start/final"


def check_model(model: str) -> None:
    if not Path(model, "config.json").exists():
        sys.exit(f"--model {model}: no HF model there (run `make demo` first, or "
                 "point it at a warm start)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, steps=12)
    parser.add_argument("--variants", default="before,base")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--workdir", default="runs/bench-steps")
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                        help="a variant NAME: base's settings, run by the code of the "
                        "checkout in DIR (repeatable)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--py-spy", help="a py-spy binary: profile the env server, the "
                        "trainer, the rollout API and vLLM's processes over the timed steps")
    parser.add_argument("--py-spy-seconds", type=int, default=20)
    args = parser.parse_args()
    resolve_run_arguments(args)
    check_model(args.model)
    for spec in args.checkout:
        name, _, where = spec.partition("=")
        if not name or not Path(where, "lachesis", "__init__.py").exists():
            sys.exit(f"--checkout {spec}: give NAME=DIR, DIR a checkout of this project")
        VARIANTS[name] = {"checkout": str(Path(where).resolve())}
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    results: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            print(f"-- {name} (round {repeat + 1})", flush=True)
            result = measure(name, VARIANTS[name], args)
            result["round"] = repeat + 1
            results.append(result)
            print(json.dumps(result), flush=True)
    by_name = {n: [r for r in results if r["variant"] == n] for n in names}
    base = statistics.median(r["median_step_s"] for r in by_name[names[0]])
    print("\n| variant | median s/step | x first | mean s/step | max s/step | completions/s | rollout gen s | turn s "
          "(env) | vLLM e2e s | queue s | prefill s | decode s | running | prefix hits |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        rs = by_name[name]
        step = statistics.median(r["median_step_s"] for r in rs)
        r = rs[-1]
        v = r["vllm_request_s"]
        print(f"| {name} | {step:.2f} | {step / base:.2f} | {r['mean_step_s']:.2f} | "
              f"{r['max_step_s']:.2f} | "
              f"{statistics.median(x['completions_per_s'] for x in rs):.1f} | "
              f"{fmt(r['rollout_generation_s'])} | {fmt(r['turn_s_env_side'])} | "
              f"{fmt(v['end_to_end'])} | {fmt(v['queue'])} | {fmt(v['prefill'])} | "
              f"{fmt(v['decode'])} | {fmt(r['vllm_running_mean'], '.1f')} | "
              f"{fmt(r['prefix_cache_hit_rate'], '.2f')} |")
    print("\nCPU (cores) over the timed steps:")
    labels = sorted({k for r in results for k in r["cpu_cores"]})
    print("| variant | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for r in results:
        print(f"| {r['variant']} | " + " | ".join(fmt(r["cpu_cores"].get(k), ".2f")
                                                  for k in labels) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
