"""Liveness without vLLM: the supervisor's own checks against small real processes. A
process that beats (as an env server does) and one that answers a health endpoint (as
the rollout API does) are SIGSTOPped; the supervisor names each within its
``hang_timeout_s`` plus a check period and a health check's wait, kills it with SIGKILL
and restarts it through
the path a dead process takes, and once the restarts are spent the run stops saying
what hung. A real ``lachesis env serve`` beats through a slow ``setup()``, and one that
never ends is named at ``liveness.setup_timeout_s``. About 35 s
wall (the tiny model's build included), 11 s CPU."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port

from environments.heartbeat import Heartbeat
from lachesis.run.config import RunConfig
from lachesis.run.liveness import Liveness, read_beats
from lachesis.run.supervisor import RunFailed, Supervisor

BEATING = ("import asyncio, sys; sys.path.insert(0, %r)\n"
           "from environments.heartbeat import from_environment\n"
           "hb = from_environment('env'); hb.doing('rollouts')\n"
           "asyncio.run(hb.beat_forever())\n" % str(REPO))


def supervisor(tmp_path: Path, **liveness) -> Supervisor:
    config = RunConfig.model_validate({
        "name": "live", "runs_dir": str(tmp_path), "model": "unused",
        "envs": [{"name": "arithmetic_tool"}], "restart_backoff_s": 0.0,
        "liveness": {"check_every_s": 0.2, "heartbeat_period_s": 0.2,
                     "health_timeout_s": 0.5, "hang_timeout_s": {"env": 1.0, "api": 1.5,
                                                               "trainer": 1.5}, **liveness}})
    sup = Supervisor(config, live=False)
    sup.run_dir.mkdir(parents=True)
    sup.liveness = Liveness(config.liveness, sup.run_dir / "heartbeat", sup.answers)
    sup.start_watching()  # as the run does: the checks in their thread
    return sup


def pid_of(sup: Supervisor, name: str) -> int:
    """The pid of the command under the guard (the process a user's SIGSTOP hits)."""
    guard = next(c for c in sup.children if c.name == name).proc.pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == guard:
                    return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no child under {name}'s guard")


def watch_until(sup: Supervisor, done, timeout_s: float) -> float:
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < timeout_s, "not noticed in time"
        sup.check_alive()
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_frozen_process_is_named_killed_and_restarted_like_a_dead_one(tmp_path, capsys):
    sup = supervisor(tmp_path)
    port = free_port()
    sup.liveness.watch("env-x", "env", beats=True, startup_s=20)
    sup.liveness.watch("api", "api", health_url=f"http://127.0.0.1:{port}/",
                       startup_s=20)
    sup.restartable = {"env-x": 1, "api": 1}
    sup.start("env-x", [sys.executable, "-c", BEATING])
    sup.start("api", [sys.executable, "-m", "http.server", str(port), "--bind",
                      "127.0.0.1", "--directory", str(tmp_path)])
    beats = sup.run_dir / "heartbeat"
    try:
        # both come up (the env beats, the API answers); nothing is taken for a hang
        watch_until(sup, lambda: read_beats(beats, "env-x")
                    and sup.answers(None, f"http://127.0.0.1:{port}/", 1.0), 20)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # busy but alive: three bounds pass, no restart
            sup.check_alive()
            time.sleep(0.05)
        assert sup.restarts == {}

        for name, bound, what in (
                ("env-x", 1.0, "has sent no heartbeat (last: env rollouts, for "),
                ("api", 1.5, f"has not answered GET http://127.0.0.1:{port}/ for ")):
            os.kill(pid_of(sup, name), signal.SIGSTOP)  # alive, answering nothing
            took = watch_until(sup, lambda n=name: sup.restarts.get(n) == 1, 15)
            # named within hang_timeout_s + a check period + a health check's wait
            assert took < bound + 0.2 + 0.5 + 1.5, (name, took)
            out = capsys.readouterr().out
            assert f"{name} (" in out and "killed it (SIGKILL): restarting it (1 of 1)" \
                in out, out
            assert what in out and "more than liveness.hang_timeout_s." in out, out
        # the restarted ones are alive again: the env beats from its new pid
        watch_until(sup, lambda: read_beats(beats, "env-x"), 20)

        os.kill(pid_of(sup, "env-x"), signal.SIGSTOP)  # again: its one restart is spent
        with pytest.raises(RunFailed, match=r"env-x \(env, this machine, pid \d+\) has sent "
                           r"no heartbeat .* killed it \(SIGKILL\) \(restarted 1 times "
                           r"already\)"):
            watch_until(sup, lambda: False, 15)
    finally:
        sup.stop_all()


def test_a_heartbeat_names_what_the_process_was_doing_and_goes_when_it_ends(tmp_path):
    heartbeat = Heartbeat(tmp_path, "trainer", "trainer", period_s=0.05).start_thread()
    heartbeat.doing("step 3: checkpoint")
    time.sleep(0.15)
    [beat] = read_beats(tmp_path, "trainer")
    assert beat["doing"] == "step 3: checkpoint" and beat["pid"] == os.getpid()
    assert time.time() - beat["at"] < 1.0
    heartbeat.stop()
    assert read_beats(tmp_path, "trainer") == []
    # a file left by a process that died is no hang: it is removed
    (tmp_path / "trainer.999999999.json").write_text('{"pid": 999999999, "at": 0}')
    assert read_beats(tmp_path, "trainer") == []
    assert not (tmp_path / "trainer.999999999.json").exists()


# Rank 0 of a two-rank gloo group waits in an all-reduce that rank 1 never joins (gloo
# lets go of the GIL: rank 0's heartbeat thread beats on; torch's own timeout is 30 min).
STALLED = ("import os, sys, time, torch, torch.distributed as dist\n"
           "sys.path.insert(0, %r)\n"
           "from environments.heartbeat import beat_in_thread, doing, progressed\n"
           "rank = int(sys.argv[1]); store = dist.TCPStore('127.0.0.1', int(sys.argv[2]), 2,"
           " rank == 0)\n"
           "dist.init_process_group('gloo', store=store, rank=rank, world_size=2)\n"
           "if rank == 1: time.sleep(3600)\n"
           "beat_in_thread('trainer'); doing('step 1: waiting for a batch')\n"
           "time.sleep(float(sys.argv[3]))  # a long wait that is no phase of progress\n"
           "doing('step 1: forward, backward, optimizer', must_progress=True)\n"
           "for _ in range(4): time.sleep(0.5); progressed()  # slow, but moving\n"
           "dist.all_reduce(torch.ones(1))\n" % str(REPO))


def test_a_rank_stuck_in_a_collective_is_a_hang_though_its_heartbeat_thread_beats(
        tmp_path, capsys):
    sup = supervisor(tmp_path)
    sup.liveness.watch("trainer", "trainer", beats=True, startup_s=30)
    sup.restartable = {"trainer": 0}
    port = free_port()
    script = tmp_path / "stalled.py"
    script.write_text(STALLED)
    # rank 1 under the same guard (its process group is killed with rank 0's)
    sup.start("trainer", ["sh", "-c", f"{sys.executable} {script} 1 {port} 0 & "
                          f"exec {sys.executable} {script} 0 {port} 2.5"])
    beats = sup.run_dir / "heartbeat"
    try:
        watch_until(sup, lambda: read_beats(beats, "trainer"), 30)
        started = time.monotonic()
        with pytest.raises(RunFailed, match=r"trainer \(trainer, this machine, pid \d+\) has "
                           r"made no progress in trainer step 1: forward, backward, optimizer"
                           r" \(its heartbeat still beats"):
            watch_until(sup, lambda: False, 30)
        took = time.monotonic() - started
        # not during the 2.5 s wait for a batch, nor the 2 s of slow progress: after them,
        # within the bound (+ a check period)
        assert 2.5 + 2.0 + 1.5 - 0.3 < took < 2.5 + 2.0 + 1.5 + 4.0, took
        assert "more than liveness.hang_timeout_s.trainer 1.5 s" in capsys.readouterr().out
    finally:
        sup.stop_all()


# An env whose setup() takes longer than the run's bound between beats, in a synchronous
# call that blocks the event loop (as TextWorld's game generation does) and lets go of
# Python's GIL (as a wait on a socket does): it finishes when the test says so.
SLOW_SETUP = '''import time
from pathlib import Path
from environments import BaseEnv

class SlowSetup(BaseEnv):
    name = "slow"

    async def setup(self):
        here = Path(__file__).parent
        while not (here / "go").exists():
            time.sleep(0.05)
        (here / "set-up").touch()
'''


def test_an_env_server_beats_through_a_slow_setup_and_a_frozen_or_endless_one_is_named(
        tmp_path, tiny_model_dir, capsys):
    sup = supervisor(tmp_path, setup_timeout_s=6.0)
    (tmp_path / "slow_env.py").write_text(SLOW_SETUP)
    sup.liveness.watch("env-slow", "env", beats=True, startup_s=60)
    sup.restartable = {"env-slow": 2}
    sup.start("env-slow", [
        sys.executable, "-m", "lachesis.cli", "env", "serve", f"{tmp_path}/slow_env.py:SlowSetup",
        "--tokenizer", str(tiny_model_dir), "--inference", "openai", "--model", "x",
        "--openai-base-url", f"http://127.0.0.1:{free_port()}/v1",
        "--api-url", f"http://127.0.0.1:{free_port()}"])  # no API yet: it waits for one
    beats = sup.run_dir / "heartbeat"

    def doing() -> str:
        return " ".join(b.get("doing", "") for b in read_beats(beats, "env-slow"))

    try:
        # its setup beats from the start (a frozen one is named by what it was doing)...
        watch_until(sup, lambda: "then SlowSetup.setup()" in doing(), 60)
        os.kill(pid_of(sup, "env-slow"), signal.SIGSTOP)
        watch_until(sup, lambda: sup.restarts.get("env-slow") == 1, 15)
        out = capsys.readouterr().out
        assert "has sent no heartbeat (last: env starting: connecting to inference, then " \
            "SlowSetup.setup()" in out and "more than liveness.hang_timeout_s.env" in out, out
        # ...one that beats on but never ends is named at liveness.setup_timeout_s, and no
        # sooner (six of the bounds between beats, each passed without a restart)...
        watch_until(sup, lambda: "then SlowSetup.setup()" in doing(), 60)
        took = watch_until(sup, lambda: sup.restarts.get("env-slow") == 2, 20)
        out = capsys.readouterr().out
        assert "has not finished starting (doing: starting: connecting to inference, then " \
            "SlowSetup.setup(); its heartbeat still beats" in out, out
        assert "more than liveness.setup_timeout_s 6 s" in out and 5.0 < took < 12.0, took
        # ...and one that ends within it is no hang: it sets up, and the serve loop's beat
        # takes over from the setup's, with no moment between unbeaten
        watch_until(sup, lambda: "then SlowSetup.setup()" in doing(), 60)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            sup.check_alive()
            time.sleep(0.05)
        (tmp_path / "go").touch()
        watch_until(sup, lambda: "registering with the rollout API" in doing(), 15)
        assert (tmp_path / "set-up").exists() and sup.restarts == {"env-slow": 2}
    finally:
        sup.stop_all()
