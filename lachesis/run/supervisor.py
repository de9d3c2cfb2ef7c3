"""``lachesis run CONFIG``: start the system as separate processes and watch over them.

Reads top to bottom:

1. prepare the policy: build the tiny model if asked, SFT warm start on env
   demonstrations (skipped when its result exists);
2. start the rollout API and the vLLM replicas (:mod:`lachesis.run.layout` says where
   each process goes), and the trainer once the API answers (it loads its model while
   vLLM starts, then waits for groups); wait until all answer;
3. evaluate every env (the "before" column);
4. start the env servers; show progress until the trainer finishes (also when it ended
   early, having had no trainable batch for ``train.max_batch_wait_s``: the run goes on
   as after a full one, and its summary says so);
5. evaluate again on the synced weights (the "after" column); write the summary table and
   the reward curve;
6. always: stop every process of the run, then kill whatever still carries the run's id.

With ``--ray ADDRESS`` the same processes run on the nodes of a Ray cluster
(:mod:`lachesis.run.ray_cluster`); the supervisor stays on the head, and each process's
log and exit reach it as a local one's do.

A process of the RL phase that dies is restarted (``max_restarts`` times at most; a vLLM
replica from the newest weights the trainer wrote, ``vllm.max_restarts`` times) while the
run goes on; one that cannot be restarted stops the run: its log's tail is printed and
the exit code is 1. A process that is alive but answers nothing (no health answer, no
heartbeat for ``liveness.hang_timeout_s``: :mod:`lachesis.run.liveness`) is named, killed
with SIGKILL and restarted the same way. Ctrl-C (or SIGTERM) stops everything cleanly.

The supervisor cannot watch itself: a frozen supervisor restarts nothing until it runs
again (its processes go on; the trainer finishes its steps). It beats into
``runs/NAME/heartbeat/supervisor.json`` on every pass of its loop, for an outside
watchdog (docs/fault-tolerance.md).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from environments.inference.tokenizer import record_tokenizer_class
from environments.settings import TOKEN_VARIABLE, bearer_headers, run_token
from lachesis.run.config import RunConfig, write_yaml
from lachesis.run.layout import (
    url_answers,
    EnvServer,
    Layout,
    Placement,
    Process,
    build_layout,
    lachesis_command,
    trainer_memory_advice,
    trainer_processes,
)
from lachesis.run.liveness import Hang, Liveness
from lachesis.run.processes import (
    RUN_ID_VARIABLE,
    ChildProcess,
    become_subreaper,
    ended_text,
    kill_leftovers,
    oom_kills_since,
)
from lachesis.run.progress import RunProgress, last_metrics
from lachesis.run.ray_cluster import PlacementFailed, RayPlacement, RayUnavailable
from trainer.checkpoint import STEP_METRICS, checkpoint_dir, checkpoint_step, latest_checkpoint
from trainer.metrics import read_stopped_early, stopped_early_text, truncate_metrics

log = logging.getLogger("lachesis.run")


class RunFailed(RuntimeError):
    """A process of the run died or did not come up; the message says which and why."""


def _post_json(url: str, payload: dict[str, Any], timeout: float = 30.0,
               token: str | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **bearer_headers(token)}
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def _get_json(url: str, timeout: float = 2.0, token: str | None = None) -> dict[str, Any] | None:
    try:
        request = urllib.request.Request(url, headers=bearer_headers(token))
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except (OSError, urllib.error.URLError, ValueError):
        return None


class Supervisor:
    def __init__(self, config: RunConfig, *, live: bool | None = None,
                 ray_address: str | None = None, resume: bool = False):
        self.config = config
        self.resume = resume
        """Continue the run in ``run_dir`` from the trainer's last complete checkpoint."""
        self.run_dir = config.run_dir
        self.run_id = uuid.uuid4().hex[:12]
        self.token = run_token() or secrets.token_urlsafe(32)
        """The run's secret (the user's ``LACHESIS_API_TOKEN``, else a new one): every
        process gets it in its environment, every server of the run requires it."""
        self.ray_address = ray_address
        """Run the processes on this Ray cluster (None: on this machine)."""
        self.placement = Placement()
        self.children: list[ChildProcess] = []
        self.live = live
        self.progress: RunProgress | None = None
        self.restartable: dict[str, int] = {}
        """Processes restarted when they die: name -> how often at most."""
        self.restart_groups: dict[str, set[str]] = {}
        """Processes restarted together (the trainer's ranks): name -> the group's names."""
        self.replica_names: set[str] = set()
        self.restarts: dict[str, int] = {}
        self.resume_command: str | None = None
        """The command that continues the run, shown when it stops."""
        self.layout: Layout | None = None
        self.liveness: Liveness | None = None
        """The liveness checks (made once the placement is known)."""
        self.hung: dict[str, Hang] = {}
        """Processes killed because they hung, until they are restarted."""
        self.lock = threading.RLock()
        """Held while processes are (re)started and while the liveness checks look at
        them and kill one, so a check never kills the new process of a restart."""
        self.watching = threading.Event()
        self.watcher: threading.Thread | None = None

    # -- processes -----------------------------------------------------------------------
    def start(self, name: str, command: list[str], *, env: dict[str, str] | None = None,
              stdout_path: Path | None = None, where: str | None = None) -> ChildProcess:
        """Start ``command`` (in place ``where`` of the placement, default ``name``'s)."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        env = {RUN_ID_VARIABLE: self.run_id, **(env or {}), TOKEN_VARIABLE: self.token,
               **(self.liveness.environment(name) if self.liveness else {})}
        with self.lock:
            if self.liveness is not None:
                self.liveness.started(name)
            if isinstance(self.placement, RayPlacement):
                child = self.placement.child(name, where or name, command, log_path, env,
                                             stdout_path).start()
            else:
                child = ChildProcess(name, command, log_path, env=env,
                                     stdout_path=stdout_path).start()
            self.children.append(child)
        self.log_started(child)
        return child

    def log_started(self, child: ChildProcess) -> None:
        if isinstance(self.placement, RayPlacement):
            log.info("started %s on %s (pid %d there), log %s", child.name,
                     self.placement.where(child.where), child.proc.pid, child.log_path)
        else:
            log.info("started %s (pid %d), log %s", child.name, child.proc.pid, child.log_path)

    def start_process(self, process: Process) -> ChildProcess:
        if process.settings is not None:
            write_yaml(*process.settings)
        return self.start(process.name, process.command, env=process.env,
                          where=process.where)

    def check_alive(self, *allowed_to_finish: ChildProcess) -> None:
        """Restart a process of the run that has exited (up to its restart limit, see
        :meth:`restart`); raise :class:`RunFailed` when one that cannot be restarted has.
        Where several have, one killed by a signal is named first: the others (e.g. the
        trainer's other ranks) most likely failed because of it."""
        self.check_live()
        dead = []
        for child in self.children:
            code = child.returncode
            if code is None or (code == 0 and child in allowed_to_finish):
                continue
            limit = self.restartable.get(child.name)
            if limit is not None and self.restarts.get(child.name, 0) < limit:
                self.restart(child, code)
                continue
            dead.append((child, code))
        if dead:
            dead.sort(key=lambda found: found[1] >= 0)
            child, code = dead[0]
            also = "".join(f"; {c.name} exited too (code {k})" for c, k in dead[1:])
            spent = (f" (restarted {self.restarts[child.name]} times already)"
                     if self.restarts.get(child.name) else "")
            how = self.ended(child, code, self.hung.get(child.name))
            raise RunFailed(f"{how}{spent}{also}; last lines "
                            f"of {child.log_path}:\n{child.log_tail()}"
                            + (f"\nto continue the run from its last checkpoint: "
                               f"{self.resume_command}" if self.resume_command else ""))

    def ended(self, child: ChildProcess, code: int, hung: Hang | None) -> str:
        """How ``child`` ended: killed by the liveness checks (``hung``), or as
        :func:`ended_text` says, and for a trainer the OOM killer may have killed, what
        makes it need less memory (its restart replays the same batches)."""
        if hung is not None:
            return f"{hung.text()}: killed it (SIGKILL)"
        oom_killed = oom_kills_since(child.oom_kills_at_start)
        text = ended_text(child.name, code, oom_killed)
        if child.name.split("-")[0] == "trainer" and code and oom_killed:
            text += f"; {trainer_memory_advice(self.config.train)}"
        return text

    def restart(self, child: ChildProcess, code: int) -> None:
        """Start a dead process of the run again, after a backoff (``restart_backoff_s``,
        doubled with each restart of it):

        * a vLLM replica on the newest weights the trainer wrote (the trainer loads newer
          ones into it once it answers);
        * the trainer (all its ranks) from its last checkpoint: it tells the rollout API,
          which releases its leases and queues again what later steps trained on;
        * the rollout API on its database (nothing accepted is lost; the others retry
          and the env servers spool meanwhile);
        * an env server: it continues its item order where it had delivered everything
          before, so the items it had in flight are sampled again;
        * a server the run started for an env (OpenEnv) on the same address."""
        group = [c for c in self.children if c.name in self.restart_groups.get(child.name,
                                                                                 {child.name})]
        with self.lock:
            for member in group:
                member.stop()  # what is left of its process group (the other ranks)
        for backend in self.layout.backends if self.layout is not None else []:
            if backend.name == child.name and backend.container is not None:
                # a docker CLI killed outright leaves its container: free the name and port
                subprocess.run(["docker", "rm", "--force", backend.container],
                               capture_output=True, check=False)
        n = self.restarts.get(child.name, 0) + 1
        for member in group:
            self.restarts[member.name] = n
        limit = self.restartable[child.name]
        weights = None
        if child.name in self.replica_names:
            weights = self.pinned_weights(child.name)
            if weights is not None:
                at = child.command.index("--model") + 1
                child.command = [*child.command[:at], str(weights), *child.command[at + 1:]]
        how = self.ended(child, code, self.hung.pop(child.name, None))
        self.say(f"{how}: restarting it ({n} of {limit})"
                 + (f" on {weights or 'the starting model'}"
                    if child.name in self.replica_names else ""))
        log.warning("%s exited with code %s; last lines of %s:\n%s", child.name, code,
                    child.log_path, child.log_tail(10))
        time.sleep(min(30.0, self.config.restart_backoff_s * 2 ** (n - 1)))
        with self.lock:
            for member in group:
                if self.liveness is not None:
                    self.liveness.started(member.name)
                member.start()
        for member in group:
            self.log_started(member)

    def check_live(self) -> None:
        """The supervisor's own heartbeat; and the liveness checks, where no watcher
        thread runs them (:meth:`start_watching`)."""
        self.beat()
        if self.watcher is None and self.liveness is not None and self.liveness.due():
            self.find_hung()

    def find_hung(self) -> None:
        """Name and kill (SIGKILL, its whole process group) each watched process that is
        hung; :meth:`check_alive` then restarts it like a dead one (or stops the run when
        its restarts are spent)."""
        with self.lock:
            children = list(self.children)
            running = {c.name for c in children if c.running}
            for hang in self.liveness.check(lambda name: name in running):
                self.say(f"{hang.text()}: killing it (SIGKILL)")
                log.warning("hung: %s", hang)
                self.hung[hang.name] = hang
                for child in children:
                    if child.name == hang.name and child.running:
                        child.kill()

    def start_watching(self) -> None:
        """Run the liveness checks every ``liveness.check_every_s`` in a thread: on
        time whatever the supervisor's loop waits for (a health check of a frozen
        process waits ``liveness.health_timeout_s``), so a frozen process is named within
        its ``hang_timeout_s`` plus a check period and a health check's wait."""
        period = self.config.liveness.check_every_s

        def watch() -> None:
            next_at = time.monotonic() + period
            while not self.watching.wait(max(0.0, next_at - time.monotonic())):
                try:
                    self.find_hung()
                except Exception:  # noqa: BLE001 - a check that fails must not end them
                    log.exception("liveness check failed")
                next_at = max(next_at + period, time.monotonic())  # a fixed schedule

        self.watcher = threading.Thread(target=watch, name="liveness", daemon=True)
        self.watcher.start()

    def stop_watching(self) -> None:
        self.watching.set()
        if self.watcher is not None:
            self.watcher.join(timeout=30)

    def beat(self) -> None:
        """The supervisor's own heartbeat, for an outside watchdog (it cannot watch
        itself): ``runs/NAME/heartbeat/supervisor.json``, rewritten every pass."""
        now = time.monotonic()
        if now - getattr(self, "_beaten", float("-inf")) < 1.0:
            return
        self._beaten = now
        path = self.run_dir / "heartbeat" / "supervisor.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(".supervisor.json.tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "at": time.time(),
                                       "run_id": self.run_id}))
            os.replace(tmp, path)
        except OSError:
            pass

    def watch(self, layout: Layout) -> None:
        """What the liveness checks watch: each process of the RL phase, by kind."""
        config, live = self.config, self.liveness
        live.watch(layout.api.name, "api", health_url=layout.api.url + "/health",
                   startup_s=config.startup_timeout_s)
        for replica in layout.replicas:
            live.watch(replica.name, "vllm", health_url=replica.url + "/health", beats=True,
                       startup_s=config.vllm.startup_timeout_s,
                       startup_setting="vllm.startup_timeout_s")
        for backend, (i, env) in zip(layout.backends, [
                (i, e) for i, e in enumerate(config.envs) if e.server is not None]):
            live.watch(backend.name, "server", health_url=backend.health_url,
                       startup_s=env.server.startup_timeout_s, where=backend.where,
                       startup_setting=f"envs[{i}].server.startup_timeout_s")
        if layout.bridge is not None:
            live.watch(layout.bridge.name, "server", health_url=layout.bridge.health_url,
                       startup_s=config.startup_timeout_s)
        for server in layout.envs:  # an atroposlib env runs its own loop: it does not beat
            if server.kind == "lachesis":
                live.watch(server.name, "env", beats=True, startup_s=config.startup_timeout_s)
        for trainer in layout.trainers:
            live.watch(trainer.name, "trainer", beats=True,
                       startup_s=config.startup_timeout_s)

    def answers(self, where: str | None, url: str, timeout_s: float) -> bool:
        """Whether ``url`` answers, asked from place ``where`` (None: from here)."""
        if where is not None and isinstance(self.placement, RayPlacement):
            return self.placement.answers(where, url)
        return url_answers(url, timeout_s)

    def pinned_weights(self, name: str) -> Path | None:
        """The newest synced weights, hard-linked into ``trainer/restart/NAME`` for replica
        ``name`` to start from: the trainer keeps only its newest two versions, and one
        it deletes while the replica is still starting would fail that start."""
        for _ in range(5):
            weights = self.newest_weights()
            if weights is None:
                return None
            pinned = self.run_dir / "trainer" / "restart" / name
            tmp = pinned.with_name(name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                shutil.copytree(weights, tmp, copy_function=os.link)
            except (OSError, shutil.Error):  # deleted under us: take the newer one
                continue
            shutil.rmtree(pinned, ignore_errors=True)
            tmp.rename(pinned)
            return pinned
        return self.newest_weights()

    def newest_weights(self) -> Path | None:
        """The newest complete weights the trainer synced (``trainer/weights/vNNNNNN``)."""
        found = [p for p in (self.run_dir / "trainer" / "weights").glob("v*")
                 if p.is_dir() and not p.name.endswith(".tmp")]
        return max(found, default=None)

    def api_status(self, api_url: str) -> dict[str, Any] | None:
        return _get_json(api_url + "/status", token=self.token)

    def wait_healthy(self, child: ChildProcess, url: str, timeout_s: float,
                     where: str | None = None) -> None:
        """Wait until ``url`` answers (asked from place ``where``: a server on loopback
        there; default: from here)."""
        deadline = time.monotonic() + timeout_s
        while not (self.placement.answers(where, url) if where else _get_json(url) is not None):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RunFailed(f"{child.name} not healthy at {url} after {timeout_s:.0f} s; "
                                f"last lines of {child.log_path}:\n{child.log_tail()}")
            time.sleep(0.5)
        log.info("%s is up at %s", child.name, url)

    def run_to_end(self, name: str, command: list[str], *, stdout_path: Path | None = None,
                   env: dict[str, str] | None = None, where: str | None = None) -> ChildProcess:
        """A one-off process (evaluation): wait for it while watching the others."""
        child = self.start(name, command, env=env, stdout_path=stdout_path, where=where)
        self.wait_for_end([child])
        return child

    def wait_for_end(self, children: list[ChildProcess]) -> None:
        """Wait until every one of ``children`` has exited 0 (one that fails stops the
        run, as does any other process of the run)."""
        while any(child.returncode is None for child in children):
            self.check_alive(*children)
            time.sleep(0.5)
        self.check_alive(*children)
        for child in children:
            self.children.remove(child)

    def stop_all(self) -> None:
        self.stop_watching()  # a process being stopped is not a hung one
        for child in reversed(self.children):
            if child.running:
                log.info("stopping %s", child.name)
            child.stop()
        if isinstance(self.placement, RayPlacement):
            self.placement.close()
        left = kill_leftovers(self.run_id)
        if left:
            log.warning("killed %d leftover process(es) of the run: %s", len(left), left)
        for process in self.layout.backends if self.layout is not None else []:
            if process.container is not None:  # a docker CLI killed outright leaves it running
                subprocess.run(["docker", "rm", "--force", process.container],
                               capture_output=True, check=False)

    # -- phases --------------------------------------------------------------------------
    def prepare_model(self) -> str:
        from environments.inference.packaged_models import resolve_model

        config = self.config
        model = resolve_model(config.model, self.say)  # a packaged model: its checkpoint
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
        # The trainer's ranks, as the RL phase's trainer runs (train.nproc, train.devices).
        ranks = [self.start_process(process) for process in trainer_processes(
            config, "warm_start", train_yaml, None, self.placement, alone=True)]
        self.wait_for_end(ranks)
        checkpoint = latest_checkpoint(sft_dir)
        if checkpoint is None:
            raise RunFailed(f"warm start wrote no checkpoint under {sft_dir / 'checkpoints'}")
        tmp = final.with_name("final.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(checkpoint, tmp)
        tmp.rename(final)
        return str(final)

    def resume_point(self) -> tuple[int, Path | None]:
        """Where the trainer will resume: the step of its newest checkpoint that verifies
        (0: none), and that checkpoint (full weights only: a LoRA checkpoint is an
        adapter, which the trainer loads into vLLM itself)."""
        checkpoint = latest_checkpoint(self.run_dir / "trainer")
        if checkpoint is None:
            return 0, None
        full = self.config.lora is None
        return checkpoint_step(checkpoint), checkpoint if full else None

    def roll_back_api(self, api_url: str, step: int) -> None:
        """Tell the rollout API the run resumes from ``step`` before any env server
        starts, so no rollout is stamped with a version that no longer exists (the
        trainer says it again once its weights are in vLLM)."""
        try:
            out = _post_json(api_url + "/resume", {"version": step,
                                                   "trainer_id": "lachesis-run"},
                             token=self.token)
        except (OSError, ValueError) as error:
            raise RunFailed(f"could not tell the rollout API at {api_url} that the run "
                            f"resumes from step {step}: {error}") from None
        self.say(f"resuming from step {step}: the rollout API released "
                 f"{out['released_leases']} leases ({out['released_groups']} groups) and "
                 f"queued again {out['requeued_groups']} groups trained after it")

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
        # An env whose demonstrator was tuned at set-up (textworld_cooking's calibrated
        # epsilon) says how: kept beside the demonstrations, and said.
        about = getattr(env, "demonstrator_summary", None)
        if about is not None:
            summary = about()
            path.with_name("demonstrator.json").write_text(json.dumps(summary, indent=1))
            self.say(f"warm start: the demonstrator: {json.dumps(summary)}")
        return path

    def evaluate(self, label: str, servers: list[EnvServer]) -> dict[str, Any]:
        """Evaluate each env with the settings of ``servers`` (its first server's);
        results by env name."""
        results = {}
        for server in servers:
            file_name = server.env_label
            out = self.run_dir / "eval" / f"{label}-{file_name}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            self.say(f"evaluating {server.env_name} ({label})")
            self.run_to_end(f"eval-{label}-{file_name}", lachesis_command(
                "env", "evaluate", server.env_name, "--config", str(server.settings[0]),
                "--eval-out", str(self.run_dir / "eval" / f"{label}-{file_name}.jsonl"),
                python=server.python), env=server.env, stdout_path=out, where=server.where)
            results[server.env_name] = json.loads(out.read_text())
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
        lap = Lap()  # from here on, every second is in a phase: they add up to the wall time
        from lachesis.run.plan import make_plan

        # What --plan flags stops the run here (on a Ray cluster, Ray gives out the GPUs).
        problems = make_plan(config, check_devices=self.ray_address is None).problems
        if problems:
            raise RunFailed("; ".join(problems) + " (lachesis run CONFIG --plan shows the "
                            "whole layout)")
        run_dir.mkdir(parents=True, exist_ok=True)
        phases: dict[str, float] = {}  # where the time went (the summary's table)
        become_subreaper()
        (run_dir / "run_id").write_text(self.run_id + "\n")  # the LACHESIS_RUN_ID of its processes
        write_yaml(run_dir / "configs" / "run.yaml", config.model_dump(mode="json"))
        if self.ray_address is not None:
            self.placement = RayPlacement(config, self.run_id)
        model = self.prepare_model()
        record_tokenizer_class(model)  # its env servers and evaluations start without torch
        phases["model (warm start)"] = lap()
        self.layout = layout = build_layout(config, model, self.placement)
        local = not isinstance(self.placement, RayPlacement)
        self.liveness = Liveness(config.liveness, run_dir / "heartbeat" if local else None,
                                 self.answers)
        self.watch(layout)
        self.start_watching()
        if isinstance(self.placement, RayPlacement):
            for process in layout.processes:  # those that listen on nothing are placed now
                self.placement.runner(process.where)
            self.say("on the Ray cluster: " + ", ".join(
                f"{p.name} on {self.placement.where(p.where)}" for p in layout.processes))
        api_url = layout.api.url

        resume_step, resume_weights = self.resume_point() if self.resume else (0, None)
        if self.resume:  # the progress display continues from the resumed step
            truncate_metrics(run_dir / "trainer" / "metrics.jsonl", resume_step,
                             checkpoint_dir(run_dir / "trainer", resume_step) / STEP_METRICS)
        if resume_weights is not None:  # vLLM serves the checkpoint's weights from the start
            for replica in layout.replicas:
                at = replica.command.index("--model") + 1
                replica.command[at] = str(resume_weights)
        api = self.start_process(layout.api)
        replicas = [self.start_process(r) for r in layout.replicas]
        backends = [self.start_process(b) for b in layout.backends]
        self.wait_healthy(api, api_url + "/health", config.startup_timeout_s)
        # The trainer loads its model while vLLM starts; it waits for the replicas to
        # answer, and trains nothing before the env servers (started after the "before"
        # evaluation) send it groups. A resumed trainer starts once the API has rolled
        # back (below).
        ranks = [] if self.resume else [self.start_process(p) for p in layout.trainers]
        for child, replica in zip(replicas, layout.replicas):
            self.wait_healthy(child, replica.url + "/health", config.vllm.startup_timeout_s)
        self.replica_names = {r.name for r in layout.replicas}
        self.restartable = {name: config.vllm.max_restarts for name in self.replica_names}
        self.restartable.update({p.name: config.max_restarts for p in [
            layout.api, *layout.backends, *layout.envs, *layout.trainers,
            *([layout.bridge] if layout.bridge is not None else [])]})
        trainer_names = {p.name for p in layout.trainers}
        self.restart_groups = {name: trainer_names for name in trainer_names}
        for child, backend, env in zip(backends, layout.backends,
                                       [e for e in config.envs if e.server is not None]):
            self.wait_healthy(child, backend.health_url, env.server.startup_timeout_s,
                              backend.where)
        if layout.bridge is not None:
            self.wait_healthy(self.start_process(layout.bridge), layout.bridge.health_url,
                              config.startup_timeout_s)

        if self.resume:
            self.roll_back_api(api_url, resume_step)
        for server in layout.envs:
            write_yaml(*server.settings)
        # Each env with its first server's settings; atroposlib envs evaluate themselves.
        evaluated = [s for s in layout.envs if s.first and s.kind == "lachesis"]
        summary: dict[str, Any] = {"run_dir": str(run_dir), "model": model,
                                   "phases": phases}
        phases["start-up"] = lap()
        if config.evaluate and config.evaluate_before:
            summary["before"] = self.evaluate("before", evaluated)
            phases["evaluation before"] = lap()

        train_dir = run_dir / "trainer"
        total_steps = int(config.train.get("steps", 100))
        training_started = time.time()
        with RunProgress(config.name, total_steps, live=self.live) as progress:
            self.progress = progress
            for server in layout.envs:
                if server.kind == "lachesis":
                    self.start_process(server)
            ranks = ranks or [self.start_process(process) for process in layout.trainers]
            # An atroposlib env reads the batch size from the API once, when it starts: it
            # starts once the trainer has registered.
            waiting = [s for s in layout.envs if s.kind == "atropos"]
            progress.phase = "training"
            while True:
                self.check_alive(*ranks)  # a dead rank is restarted (or the run stops)
                if all(rank.returncode == 0 for rank in ranks):
                    break
                if waiting and (self.api_status(api_url) or {}).get("trainer_registered"):
                    for server in waiting:
                        self.start_process(server)
                    waiting = []
                progress.processes = {c.name: "up" if c.running else f"exit {c.returncode}"
                                      for c in self.children}
                progress.update(last_metrics(train_dir / "metrics.jsonl"),
                                self.api_status(api_url))
                time.sleep(1.0)
            for rank in ranks:
                self.children.remove(rank)
            stopped = read_stopped_early(train_dir)
            if stopped is not None:  # max_batch_wait_s: the run goes on as after a full one
                summary["stopped_early"] = stopped
                progress.phase = "stopped early"
            progress.update(last_metrics(train_dir / "metrics.jsonl"),
                            self.api_status(api_url))
            if stopped is not None:
                self.say(stopped_early_text(stopped) + " (max_batch_wait_s; the trainer's "
                         "log says why); evaluating its last weights")
            self.progress = None
        phases["training"] = lap()
        summary["training"] = {"started_at": training_started, "ended_at": time.time(),
                               "trainer_hung_s": sum(
                                   h.silent_s for h in self.liveness.hangs
                                   if h.kind == "trainer" and h.at >= training_started)}
        summary["hangs"] = [{"name": h.name, "kind": h.kind, "address": h.address,
                             "silent_s": round(h.silent_s, 1), "bound_s": h.bound_s,
                             "what": h.what} for h in self.liveness.hangs]
        accounting = _get_json(api_url + "/accounting", timeout=30, token=self.token)
        if accounting is not None:
            from lachesis.run.report import accounting_text

            summary["accounting"] = accounting
            self.say("rollout accounting:\n" + accounting_text(accounting))
        for child in [c for c in self.children if c.name.startswith("env-")]:
            child.stop()  # no more rollouts: vLLM now serves the final weights
            self.children.remove(child)
        phases["accounting, stopping the env servers"] = lap()
        if config.evaluate:
            summary["after"] = self.evaluate("after", evaluated)
            phases["evaluation after"] = lap()

        if self.restarts:
            summary["restarts"] = dict(self.restarts)
            replicas = {k: v for k, v in self.restarts.items() if k in self.replica_names}
            if replicas:
                summary["vllm_restarts"] = replicas
        from lachesis.run.report import write_summary

        summary["wall_s"] = lap.since_start()  # what the phases add up to
        summary.update(write_summary(run_dir, summary, train_dir / "metrics.jsonl"))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary


class Lap:
    """Seconds since the previous call (or since it was made)."""

    def __init__(self) -> None:
        self.last = self.first = time.monotonic()

    def since_start(self) -> float:
        return time.monotonic() - self.first

    def __call__(self) -> float:
        now = time.monotonic()
        seconds, self.last = now - self.last, now
        return seconds


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
        live: bool | None = None, ray_address: str | None = None,
        resume_command: str | None = None) -> int:
    """Run the whole system (on the Ray cluster at ``ray_address``, else on this machine);
    returns the exit code (0: the trainer finished). ``resume_command``: the command that
    continues this run (shown when it stops)."""
    run_dir = config.run_dir
    if ray_address is not None:
        from lachesis.run.ray_cluster import alive_nodes, connect, ray_problems

        try:
            nodes = alive_nodes(connect(ray_address))
        except RayUnavailable as error:
            print(f"lachesis run: {error}", file=sys.stderr, flush=True)
            return 2
        problems = ray_problems(config, nodes)
        if problems:
            print(f"lachesis run: cannot run on the Ray cluster at {ray_address} "
                  f"({len(nodes)} nodes):\n" + "\n".join(f"  - {p}" for p in problems),
                  file=sys.stderr, flush=True)
            return 2
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
    supervisor = Supervisor(config, live=live, ray_address=ray_address, resume=resume)
    supervisor.resume_command = resume_command

    def on_signal(signum, frame):  # SIGTERM is handled like Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C stops the run even where SIGINT came in ignored (e.g. a `cmd &` in a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        summary = supervisor.run()
        print(summary.get("table", ""), flush=True)
        for text in summary.get("transcripts", []):
            print(text, flush=True)
        print(summary.get("time_table", ""), flush=True)
        if summary.get("stopped_early"):
            print(stopped_early_text(summary["stopped_early"]), flush=True)
        print(f"run directory: {run_dir}", flush=True)
        return 0
    except (RunFailed, PlacementFailed) as error:
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
