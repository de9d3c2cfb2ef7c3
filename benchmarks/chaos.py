"""Chaos: one ``lachesis run`` during which a driver kills, at seeded random moments, the
trainer, an env server, a vLLM replica, the rollout API and the whole run (then
``lachesis run CONFIG --resume``). The run must finish; afterwards the rollout accounting
must add up, the metrics must hold every step exactly once, and the final evaluation
must have run. Prints the fault log and the accounting; exits 1 when a check fails.

    python benchmarks/chaos.py CONFIG --faults 8 --seed 1

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

KINDS = ("trainer", "env", "vllm", "api", "run")
# What a process's command line holds (the guard that leads its group is not it).
MARKERS = {"trainer": b"lachesis.cli\0train\0", "env": b"\0env\0serve\0",
           "vllm": b"environments.inference.vllm_serve", "api": b"lachesis.cli\0api\0"}


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
    note: str = ""


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


def process_ids(run_dir: Path, kind: str) -> list[int]:
    run_id = (run_dir / "run_id").read_text().strip()
    found = []
    for pid in processes_of_run(run_id):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if MARKERS[kind] in cmd and b"lachesis.run.guard" not in cmd:
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
        pids = process_ids(self.run_dir, fault.kind)
        if not pids:
            fault.note = "no such process at that moment (restarting?): skipped"
            return
        fault.pids = [random.Random(fault.step).choice(pids)]
        os.kill(fault.pids[0], signal.SIGKILL)

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
            print(f"[{fault.at_s:7.1f} s] step {fault.at_step}: killed {fault.kind} "
                  f"{fault.pids} {fault.note}", flush=True)
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
        db = QueueDB(self.run_dir / "api" / "queue.sqlite")
        accounting = db.accounting()
        db.close()
        problems += accounting_problems(accounting)
        print(f"\nchaos: {self.config.name}, {self.steps} steps, seed {self.args.seed}, "
              f"{len(faults)} faults, {self.now():.0f} s in all, {self.runs} `lachesis run` "
              f"starts, restarts by the supervisor: {summary.get('restarts', {})}")
        print(f"{'#':>2} {'kind':8} {'at step':>7} {'+delay':>6} {'time':>8} "
              f"{'recovered in':>12}  pids")
        for i, f in enumerate(faults, 1):
            recovered = f"{f.recovered_s:.1f} s" if f.recovered_s is not None else "-"
            print(f"{i:>2} {f.kind:8} {f.at_step if f.at_step is not None else '-':>7} "
                  f"{f.delay_s:>5.2f}s {f.at_s:>7.1f}s {recovered:>12}  {f.pids} {f.note}")
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
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"which processes to kill, comma-separated (default: {','.join(KINDS)})")
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
