"""Chaos: one ``lachesis run`` during which a driver kills or freezes, at seeded random
moments, the trainer, an env server, a vLLM replica, the rollout API and the whole run
(then ``lachesis run CONFIG --resume``). The run must finish; afterwards the rollout
accounting must add up, the metrics must hold every step exactly once, the final
evaluation must have run, and "where the time went" must add up to the run's wall time.
Prints the fault log and the accounting; exits 1 when a check fails.

    python benchmarks/chaos.py CONFIG --faults 8 --seed 1
    python benchmarks/chaos.py CONFIG --faults 10 --kinds trainer,env,freeze-trainer,...

Fault kinds: ``trainer``, ``env``, ``vllm``, ``api``: SIGKILL of that process; ``run``:
SIGKILL of every process of the run, the supervisor too, then ``--resume``;
``freeze-KIND`` (KIND one of ``trainer``, ``env``, ``vllm`` (a replica's API server),
``engine`` (its engine core), ``api``): SIGSTOP for good, which the supervisor must
notice within that kind's ``liveness.hang_timeout_s`` plus a check period (and a health
check's wait), name, kill and restart (checked: the run's output must name it in time);
``pause-KIND`` (those, and ``supervisor``): SIGSTOP for ``--pause-s``, then SIGCONT.

A fault lands a random share of a step's duration (the last logged ``time/step``) after
the trainer logged a randomly chosen step, or as that next step ends if it is sooner, so
inside the next step however fast steps are here: during a step, a weight sync, a checkpoint write or an evaluation, wherever that falls. Each
fault waits until the run has recovered from the one before (the trainer logged a step
past the step of that fault). ``--fresh-rl`` keeps an existing warm start and starts the
RL phase over (the warm start is what takes long on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.processes import processes_of_run  # noqa: E402
from lachesis.run.progress import last_metrics  # noqa: E402
from lachesis.run.report import accounting_problems, accounting_text  # noqa: E402

KILLS = ("trainer", "env", "vllm", "api", "run")
FROZEN = ("trainer", "env", "vllm", "engine", "api")
KINDS = (*KILLS, *(f"freeze-{k}" for k in FROZEN),
         *(f"pause-{k}" for k in (*FROZEN, "supervisor")))
# What a process's command line holds (the guard that leads its group is not it).
MARKERS = {"trainer": b"lachesis.cli\0train\0", "env": b"\0env\0serve\0",
           "vllm": b"environments.inference.vllm_serve", "api": b"lachesis.cli\0api\0"}
LIVENESS_KIND = {"trainer": "trainer", "env": "env", "vllm": "vllm", "engine": "vllm",
                 "api": "api"}
"""The ``liveness.hang_timeout_s`` that bounds a freeze of each target."""


@dataclass
class Fault:
    kind: str
    step: int
    """Strikes once the trainer has logged this step..."""
    fraction: float
    """...this share of a step's duration after (the last step's ``time/step``), so the
    fault lands inside the next step however fast steps are on this machine."""
    delay_s: float = 0.0
    at_step: int | None = None
    pids: list[int] = field(default_factory=list)
    at_s: float = 0.0
    recovered_s: float | None = None
    noticed_s: float | None = None
    """A freeze for good: seconds until the run's output named the process."""
    named: str = ""
    """What the run printed when it named it."""
    note: str = ""

    @property
    def target(self) -> str:
        """The process kind struck (``trainer`` for ``freeze-trainer``)."""
        return self.kind.split("-", 1)[-1]


def plan(n: int, kinds: list[str], steps: int, rng: random.Random) -> list[Fault]:
    """``n`` faults: every kind once (in a random order) before any repeats; at distinct
    random steps from 2 to ``steps - 2``."""
    order: list[str] = []
    while len(order) < n:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    candidates = list(range(2, steps - 1))
    if n > len(candidates):
        raise SystemExit(f"{n} faults need at least {n + 3} steps (train.steps is {steps})")
    at = sorted(rng.sample(candidates, n))
    return [Fault(kind, step, round(rng.uniform(0.0, 1.0), 2))
            for kind, step in zip(order[:n], at)]


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def process_ids(run_dir: Path, kind: str) -> list[int]:
    """The processes of ``kind`` (``engine``: a vLLM engine core, a child of a vLLM API
    server; vLLM forks it on a CPU, so its command line is its parent's or its own
    process title)."""
    run_id = (run_dir / "run_id").read_text().strip()
    found, commands = [], {}
    for pid in processes_of_run(run_id):
        try:
            commands[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
    def vllm(cmd: bytes) -> bool:  # a vLLM server's process, not the guard above it
        return MARKERS["vllm"] in cmd and b"lachesis.run.guard" not in cmd

    servers = {pid for pid, cmd in commands.items()
               if vllm(cmd) and not vllm(commands.get(parent_pid(pid), b""))}
    for pid, cmd in commands.items():
        if kind == "engine":
            if parent_pid(pid) in servers and (b"EngineCore" in cmd or MARKERS["vllm"] in cmd):
                found.append(pid)
        elif kind == "vllm":
            if pid in servers:
                found.append(pid)
        elif MARKERS[kind] in cmd and b"lachesis.run.guard" not in cmd:
            found.append(pid)
    return found


class Chaos:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.config = RunConfig.load(args.config)
        self.run_dir = self.config.run_dir
        self.steps = int(self.config.train.get("steps", 100))
        self.metrics = self.run_dir / "trainer" / "metrics.jsonl"
        log_path = args.log or self.run_dir.with_name(self.run_dir.name + "-chaos.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "a")
        self.run: subprocess.Popen | None = None
        self.started = time.monotonic()
        self.runs = 0

    def now(self) -> float:
        return time.monotonic() - self.started

    def start_run(self, how: str) -> None:
        self.runs += 1
        self.log.write(f"\n=== lachesis run {how} (start {self.runs}) at {self.now():.1f} s\n")
        self.log.flush()
        self.run = subprocess.Popen(
            [sys.executable, "-m", "lachesis.cli", "run", str(self.args.config), how],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=os.getcwd(),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})

    def step(self) -> int:
        return (last_metrics(self.metrics) or {}).get("step", 0)

    def step_seconds(self) -> float:
        """The last logged step's duration (1 s before any is logged)."""
        last = last_metrics(self.metrics) or {}
        return float(last.get("time/step") or last.get("step_seconds") or 1.0)

    def wait_step(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.step() < step:
            if self.run.poll() is not None:
                raise SystemExit(f"the run exited with code {self.run.returncode} before "
                                 f"step {step}; see {self.log.name}")
            if time.monotonic() > deadline:
                raise SystemExit(f"no step {step} after {timeout_s:.0f} s; see {self.log.name}")
            time.sleep(0.2)

    def sleep_within_step(self, delay_s: float) -> None:
        """Sleep ``delay_s``, but no longer than the step under way lasts: the last logged
        step can have been slow (a restart, a batch wait) and the next ones fast (queued
        groups), and a fault must land inside the step after the one it was planned at,
        not steps later or after the run's last step."""
        step, deadline = self.step(), time.monotonic() + delay_s
        while time.monotonic() < deadline and self.step() == step and self.run.poll() is None:
            time.sleep(0.05)

    def strike(self, fault: Fault) -> None:
        fault.at_step, fault.at_s = self.step(), self.now()
        if fault.kind == "run":  # a power cut: the supervisor and every process at once
            run_id = (self.run_dir / "run_id").read_text().strip()
            fault.pids = [self.run.pid, *processes_of_run(run_id)]
            for pid in fault.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.run.wait()
            deadline = time.monotonic() + 30
            while processes_of_run(run_id) and time.monotonic() < deadline:
                time.sleep(0.2)
            fault.note = "then: lachesis run CONFIG --resume"
            self.start_run("--resume")
            return
        if fault.kind == "pause-supervisor":
            fault.pids = [self.run.pid]
        else:
            pids = process_ids(self.run_dir, fault.target)
            if not pids:
                fault.note = "no such process at that moment (restarting?): skipped"
                return
            fault.pids = [random.Random(fault.step).choice(pids)]
        if fault.kind in KILLS:
            os.kill(fault.pids[0], signal.SIGKILL)
            return
        offset = self.log_size()
        os.kill(fault.pids[0], signal.SIGSTOP)
        if fault.kind.startswith("pause-"):
            time.sleep(self.args.pause_s)
            try:
                os.kill(fault.pids[0], signal.SIGCONT)
            except ProcessLookupError:
                fault.note = "(killed while paused)"
            fault.note = fault.note or f"SIGCONT after {self.args.pause_s:g} s"
            return
        self.await_named(fault, offset)

    def log_size(self) -> int:
        self.log.flush()
        return Path(self.log.name).stat().st_size

    def bound(self, fault: Fault) -> float:
        """How long the supervisor may take to name a process frozen for good."""
        live = self.config.liveness
        hang = getattr(live.hang_timeout_s, LIVENESS_KIND[fault.target])
        # + 1 s: this driver reads the run's output every 0.2 s, the run flushes it
        return hang + live.check_every_s + live.health_timeout_s + 1.0

    def await_named(self, fault: Fault, offset: int) -> None:
        """Wait until the run's output names the frozen process (or the bound and 60 s
        more pass: the report then counts it a failed check)."""
        struck = time.monotonic()
        deadline = struck + self.bound(fault) + 60
        name_of = {"trainer": "trainer", "env": "env-", "vllm": "vllm", "engine": "vllm",
                   "api": "api"}[fault.target]
        while time.monotonic() < deadline and self.run.poll() is None:
            with open(self.log.name, "rb") as f:
                f.seek(offset)
                new = f.read().decode(errors="replace")
            for line in new.splitlines():
                if "killing it (SIGKILL)" in line and line.startswith(name_of):
                    fault.noticed_s, fault.named = time.monotonic() - struck, line.strip()
                    return
            time.sleep(0.2)
        if self.step() >= self.steps:  # the run ended its training before the bound
            fault.note = "not named: the trainer's last step came first (the run stopped it)"
        else:
            fault.note = "not named by the run"

    def main(self) -> int:
        args = self.args
        rng = random.Random(args.seed)
        kinds = args.kinds.split(",")
        faults = plan(args.faults, kinds, self.steps, rng)
        if args.fresh_rl and (self.run_dir / "warm_start" / "final").exists():
            for path in self.run_dir.iterdir():  # keep the warm start, forget the RL phase
                if path.name != "warm_start":
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            self.start_run("--resume")
        else:
            self.start_run("--fresh")
        for fault in faults:
            if self.run.poll() is not None:  # a fault before this one landed after the
                fault.note = "the run had ended: skipped"  # last step, and the run is done
                continue
            self.wait_step(fault.step, args.timeout_s)
            fault.delay_s = fault.fraction * self.step_seconds()
            self.sleep_within_step(fault.delay_s)
            self.strike(fault)
            verb = "killed" if fault.kind in KILLS else \
                {"freeze": "froze", "pause": "paused"}[fault.kind.split("-")[0]]
            print(f"[{fault.at_s:7.1f} s] step {fault.at_step}: {verb} {fault.target} "
                  f"{fault.pids} {fault.note}"
                  + (f"; named after {fault.noticed_s:.1f} s: {fault.named}"
                     if fault.noticed_s is not None else ""), flush=True)
            if fault.pids and fault.at_step >= self.steps:
                # it hit the run's last moments (the last step's sync or checkpoint, the
                # final evaluation): recovered once the run ends, which the report checks
                self.run.wait(timeout=args.timeout_s)
                fault.recovered_s = self.now() - fault.at_s
            elif fault.pids:  # recovered once the trainer logs a step past this one
                self.wait_step(fault.at_step + 1, args.timeout_s)
                fault.recovered_s = self.now() - fault.at_s
        code = self.run.wait(timeout=args.timeout_s)
        return self.report(faults, code)

    def report(self, faults: list[Fault], code: int) -> int:
        from environments.api.queue_db import QueueDB

        problems = []
        if code != 0:
            problems.append(f"the run exited with code {code} (see {self.log.name})")
        steps = [json.loads(line)["step"] for line in self.metrics.read_text().splitlines()]
        if steps != list(range(1, self.steps + 1)):
            problems.append(f"metrics hold steps {steps}, not 1..{self.steps} once each")
        summary_path = self.run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        if self.config.evaluate and not summary.get("after"):
            problems.append("no final evaluation in summary.json")
        for f in faults:
            if f.kind.startswith("freeze-") and f.pids and "last step came first" not in \
                    f.note and (f.noticed_s is None or f.noticed_s > self.bound(f)):
                problems.append(f"fault {f.kind} at step {f.at_step}: named after "
                                f"{f.noticed_s} s, bound {self.bound(f):g} s "
                                "(hang_timeout_s + check_every_s + health_timeout_s + 1 s)")
        if summary.get("phases"):
            total = sum(summary["phases"].values())
            if abs(total - summary.get("wall_s", total)) > 1.0:
                problems.append(f"where the time went: the phases add up to {total:.1f} s, "
                                f"the run took {summary['wall_s']:.1f} s")
            if "outside the steps" not in summary.get("time_table", "outside the steps"):
                problems.append("where the time went: no row outside the trainer's steps")
        db = QueueDB(self.run_dir / "api" / "queue.sqlite")
        accounting = db.accounting()
        db.close()
        problems += accounting_problems(accounting)
        print(f"\nchaos: {self.config.name}, {self.steps} steps, seed {self.args.seed}, "
              f"{len(faults)} faults, {self.now():.0f} s in all, {self.runs} `lachesis run` "
              f"starts, restarts by the supervisor: {summary.get('restarts', {})}")
        print(f"{'#':>2} {'kind':16} {'at step':>7} {'+delay':>6} {'time':>8} "
              f"{'named in':>8} {'recovered in':>12}  pids")
        for i, f in enumerate(faults, 1):
            recovered = f"{f.recovered_s:.1f} s" if f.recovered_s is not None else "-"
            named = f"{f.noticed_s:.1f} s" if f.noticed_s is not None else "-"
            print(f"{i:>2} {f.kind:16} {f.at_step if f.at_step is not None else '-':>7} "
                  f"{f.delay_s:>5.2f}s {f.at_s:>7.1f}s {named:>8} {recovered:>12}  {f.pids} "
                  f"{f.note}")
        for f in faults:
            if f.named:
                print(f"  {f.kind}: {f.named}")
        if summary.get("time_table"):
            print("\n" + summary["time_table"])
        print("\nrollout accounting:\n" + accounting_text(accounting))
        print(f"metrics: {len(steps)} lines, steps {steps[0] if steps else '-'}.."
              f"{steps[-1] if steps else '-'}; final evaluation: "
              f"{'ran' if summary.get('after') else 'missing'}; exit code {code}")
        for problem in problems:
            print(f"FAILED: {problem}")
        print("chaos: " + ("all checks passed" if not problems else f"{len(problems)} checks failed"))
        return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KILLS),
                        help="which faults, comma-separated, from: " + ", ".join(KINDS)
                        + f" (default: {','.join(KILLS)})")
    parser.add_argument("--pause-s", type=float, default=10.0,
                        help="how long a pause-KIND fault keeps the process stopped")
    parser.add_argument("--fresh-rl", action="store_true",
                        help="keep an existing warm start, start the RL phase over")
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="longest wait for a step, a recovery or the end")
    parser.add_argument("--log", type=Path, help="the runs' output (default: beside the run)")
    args = parser.parse_args(argv)
    bad = set(args.kinds.split(",")) - set(KINDS)
    if bad:
        parser.error(f"--kinds: unknown {sorted(bad)}; choose from {', '.join(KINDS)}")
    return Chaos(args).main()


if __name__ == "__main__":
    sys.exit(main())
