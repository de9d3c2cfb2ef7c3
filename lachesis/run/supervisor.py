"""``lachesis run CONFIG``: start the system as separate processes and watch over them.

Reads top to bottom:

1. prepare the policy: build the tiny model if asked, SFT warm start on env
   demonstrations (skipped when its result exists);
2. start the rollout API and vLLM; wait until both answer;
3. evaluate every env (the "before" column);
4. start one server per env and the trainer; show progress until the trainer finishes;
5. evaluate again on the synced weights (the "after" column); write the summary table and
   the reward curve;
6. always: stop every process of the run, then kill whatever still carries the run's id.

A process that dies stops the run: its log's tail is printed and the exit code is 1.
Ctrl-C (or SIGTERM) stops everything cleanly.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from lachesis.run.config import RunConfig, write_yaml
from lachesis.run.processes import (
    RUN_ID_VARIABLE,
    ChildProcess,
    become_subreaper,
    kill_leftovers,
)
from lachesis.run.progress import RunProgress, last_metrics

log = logging.getLogger("lachesis.run")


class RunFailed(RuntimeError):
    """A process of the run died or did not come up; the message says which and why."""


def _free_port() -> int:
    from environments.inference.vllm_process import free_port

    return free_port()


def _get_json(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _lachesis(*args: str) -> list[str]:
    return [sys.executable, "-m", "lachesis.cli", *args]


class Supervisor:
    def __init__(self, config: RunConfig, *, live: bool | None = None):
        self.config = config
        self.run_dir = config.run_dir
        self.run_id = uuid.uuid4().hex[:12]
        self.children: list[ChildProcess] = []
        self.live = live
        self.progress: RunProgress | None = None

    # -- processes -----------------------------------------------------------------------
    def start(self, name: str, command: list[str], *, env: dict[str, str] | None = None,
              stdout_path: Path | None = None) -> ChildProcess:
        child = ChildProcess(name, command, self.run_dir / "logs" / f"{name}.log",
                             env={RUN_ID_VARIABLE: self.run_id, **(env or {})},
                             stdout_path=stdout_path).start()
        self.children.append(child)
        log.info("started %s (pid %d), log %s", name, child.proc.pid, child.log_path)
        return child

    def check_alive(self, *allowed_to_finish: ChildProcess) -> None:
        """Raise :class:`RunFailed` when a process of the run has exited."""
        for child in self.children:
            code = child.returncode
            if code is None or (code == 0 and child in allowed_to_finish):
                continue
            raise RunFailed(f"{child.name} exited with code {code}; last lines of "
                            f"{child.log_path}:\n{child.log_tail()}")

    def wait_healthy(self, child: ChildProcess, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while _get_json(url) is None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RunFailed(f"{child.name} not healthy at {url} after {timeout_s:.0f} s; "
                                f"last lines of {child.log_path}:\n{child.log_tail()}")
            time.sleep(0.5)
        log.info("%s is up at %s", child.name, url)

    def run_to_end(self, name: str, command: list[str], *, stdout_path: Path | None = None,
                   env: dict[str, str] | None = None) -> ChildProcess:
        """A one-off process (SFT, evaluation): wait for it while watching the others."""
        child = self.start(name, command, env=env, stdout_path=stdout_path)
        while child.returncode is None:
            self.check_alive(child)
            time.sleep(0.5)
        self.check_alive(child)
        self.children.remove(child)
        return child

    def stop_all(self) -> None:
        for child in reversed(self.children):
            if child.running:
                log.info("stopping %s", child.name)
            child.stop()
        left = kill_leftovers(self.run_id)
        if left:
            log.warning("killed %d leftover process(es) of the run: %s", len(left), left)

    # -- phases --------------------------------------------------------------------------
    def prepare_model(self) -> str:
        config = self.config
        model = config.model
        if config.build_tiny_model and not Path(model).exists():
            from lachesis.tiny_model import make_tiny_model

            self.say(f"building the tiny model in {model}")
            settings = config.build_tiny_model
            make_tiny_model(model, **(settings if isinstance(settings, dict) else {}))
        if config.warm_start is None:
            return model
        sft_dir = self.run_dir / "warm_start"
        final = sft_dir / "final"
        if final.exists():
            self.say(f"warm start: reusing {final}")
            return str(final)
        ws = config.warm_start
        demos = self.write_demonstrations(sft_dir / "demonstrations.jsonl", model)
        train_yaml = write_yaml(self.run_dir / "configs" / "warm_start.yaml", {
            **ws.train, "model": model, "mode": "sft", "data": demos,
            "run_dir": sft_dir, "api_url": None, "tensorboard": False})
        self.say(f"warm start: SFT on {ws.demonstrations} {ws.env} demonstrations")
        self.run_to_end("warm_start", _lachesis("train", "--config", str(train_yaml)))
        checkpoints = sorted((sft_dir / "checkpoints").glob("step_*"))
        if not checkpoints:
            raise RunFailed(f"warm start wrote no checkpoint under {sft_dir / 'checkpoints'}")
        shutil.copytree(checkpoints[-1], final)
        return str(final)

    def write_demonstrations(self, path: Path, tokenizer: str) -> Path:
        import asyncio

        from lachesis.env_kinds import load_env_class

        ws = self.config.warm_start
        env_class = load_env_class(ws.env)
        env = env_class(env_class.config_class(**{**ws.settings, "tokenizer": tokenizer}))
        tools = [t.schema() for t in env.tools]

        async def items() -> list[Any]:
            await env.setup()
            return [await env.get_next_item() for _ in range(ws.demonstrations)]

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for item in asyncio.run(items()):
                f.write(json.dumps({"messages": env.oracle_messages(item), "tools": tools}) + "\n")
        tmp.rename(path)
        return path

    def evaluate(self, label: str, env_yamls: list[tuple[str, Path]]) -> dict[str, Any]:
        results = {}
        for name, env_yaml in env_yamls:
            out = self.run_dir / "eval" / f"{label}-{name}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            self.say(f"evaluating {name} ({label})")
            self.run_to_end(f"eval-{label}-{name}", _lachesis(
                "env", "evaluate", name, "--config", str(env_yaml),
                "--eval-out", str(self.run_dir / "eval" / f"{label}-{name}.jsonl")),
                stdout_path=out)
            results[name] = json.loads(out.read_text())
        return results

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, flush=True)
        log.info(text)

    # -- the run -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        config, run_dir = self.config, self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        become_subreaper()
        (run_dir / "run_id").write_text(self.run_id + "\n")  # the LACHESIS_RUN_ID of its processes
        write_yaml(run_dir / "configs" / "run.yaml", config.model_dump(mode="json"))
        model = self.prepare_model()

        api_port = config.api.get("port") or _free_port()
        api_url = f"http://127.0.0.1:{api_port}"
        api_yaml = write_yaml(run_dir / "configs" / "api.yaml", {
            **config.api, "host": "127.0.0.1", "port": api_port,
            "db": run_dir / "api" / "queue.sqlite"})
        api = self.start("api", _lachesis("api", "--config", str(api_yaml)))

        from environments.inference.vllm_process import VLLMProcess
        from trainer.config import TrainConfig
        from trainer.vllm_sync import vllm_options

        v = config.vllm
        # What the trainer's weight sync needs of vLLM (LoRA, a weight-transfer backend).
        sync_args, sync_env = vllm_options(TrainConfig.model_validate(
            {**config.rl_train, "model": model}))
        server = VLLMProcess(model, port=v.port, max_model_len=v.max_model_len, dtype=v.dtype,
                             kv_cache_space_gib=v.kv_cache_gib, dev_mode=True,
                             gpu_memory_utilization=v.gpu_memory_utilization,
                             served_model_name="policy", extra_args=[*v.args, *sync_args],
                             env=sync_env, log_path=run_dir / "logs" / "vllm.log")
        environment = server.environment()
        vllm = self.start("vllm", server.command(), env={
            k: environment[k] for k in ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE",
                                        *sync_env) if k in environment})
        self.wait_healthy(api, api_url + "/status", config.startup_timeout_s)
        self.wait_healthy(vllm, server.url + "/health", v.startup_timeout_s)

        env_yamls = []
        for env in config.envs:
            env_yamls.append((env.name, write_yaml(run_dir / "configs" / f"env-{env.name}.yaml", {
                **env.settings, "api_url": api_url, "inference_servers": [server.url],
                "tokenizer": model, "jsonl_out": run_dir / "trajectories" / f"{env.name}.jsonl",
                "spool_path": run_dir / "spool" / f"{env.name}.jsonl"})))
        summary: dict[str, Any] = {"run_dir": str(run_dir), "model": model}
        if config.evaluate and config.evaluate_before:
            summary["before"] = self.evaluate("before", env_yamls)

        train_dir = run_dir / "trainer"
        train_yaml = write_yaml(run_dir / "configs" / "train.yaml", {
            **config.rl_train, "model": model, "mode": "rl", "api_url": api_url,
            "vllm_urls": [server.url], "run_dir": train_dir})
        total_steps = int(config.train.get("steps", 100))
        with RunProgress(config.name, total_steps, live=self.live) as progress:
            self.progress = progress
            for name, env_yaml in env_yamls:
                self.start(f"env-{name}", _lachesis("env", "serve", name, "--config", str(env_yaml)))
            trainer = self.start("trainer", _lachesis("train", "--config", str(train_yaml)))
            progress.phase = "training"
            while trainer.returncode is None:
                self.check_alive(trainer)
                progress.processes = {c.name: "up" if c.running else f"exit {c.returncode}"
                                      for c in self.children}
                progress.update(last_metrics(train_dir / "metrics.jsonl"),
                                _get_json(api_url + "/status"))
                time.sleep(1.0)
            self.check_alive(trainer)
            self.children.remove(trainer)
            progress.update(last_metrics(train_dir / "metrics.jsonl"),
                            _get_json(api_url + "/status"))
            self.progress = None
        for child in [c for c in self.children if c.name.startswith("env-")]:
            child.stop()  # no more rollouts: vLLM now serves the final weights
            self.children.remove(child)
        if config.evaluate:
            summary["after"] = self.evaluate("after", env_yamls)

        from lachesis.run.report import write_summary

        summary.update(write_summary(run_dir, summary, train_dir / "metrics.jsonl"))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary


def run_quietly(config: RunConfig) -> dict[str, Any]:
    """Run the whole system from scratch (an unfinished earlier attempt is removed) without
    the live display, for experiment scripts; returns the summary with ``seconds``."""
    config.check_sections()
    if config.run_dir.exists():
        shutil.rmtree(config.run_dir)
    config.run_dir.mkdir(parents=True)
    supervisor = Supervisor(config, live=False)
    started = time.monotonic()
    try:
        summary = supervisor.run()
    finally:
        supervisor.stop_all()
    summary["seconds"] = time.monotonic() - started
    return summary


def run(config: RunConfig, *, fresh: bool = False, resume: bool = False,
        live: bool | None = None) -> int:
    """Run the whole system; returns the exit code (0: the trainer finished)."""
    run_dir = config.run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        if fresh:
            shutil.rmtree(run_dir)
        elif not resume:
            print(f"lachesis run: {run_dir} already holds a run: pass --fresh to start over "
                  "or --resume to continue it", file=sys.stderr)
            return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, filename=run_dir / "run.log",
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    supervisor = Supervisor(config, live=live)

    def on_signal(signum, frame):  # SIGTERM is handled like Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C stops the run even where SIGINT came in ignored (e.g. a `cmd &` in a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        summary = supervisor.run()
        print(summary.get("table", ""), flush=True)
        print(f"run directory: {run_dir}", flush=True)
        return 0
    except RunFailed as error:
        print(f"lachesis run: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("lachesis run: interrupted; stopping every process", file=sys.stderr, flush=True)
        return 130
    finally:
        # A second Ctrl-C must not cut the clean-up short.
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            supervisor.stop_all()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous)
