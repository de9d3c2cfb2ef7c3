"""Trajectory-API throughput: Lachesis vs. Atropos, side by side in one run.

Workload (defaults; every number is a flag):
  * N = 200 groups (--groups; 200-400 is the documented range), each an Atropos
    ScoredData JSON body of 8 sequences (--group-size) x 1024 tokens (--seq-len):
      {"tokens": [[...]] x8, "masks": [[...]] x8, "scores": [8 floats],
       "group_id": "<uuid>"}
    Masks follow the Atropos convention: -100 on the first 200 (prompt)
    positions, the token id itself on the rest. Fixed random seed (--seed).
  * The request bodies are JSON-encoded once, before any timing (and gzipped
    once with --gzip, sent with "Content-Encoding: gzip"); the very same bytes go
    to every server, so the client's encoding cost is not what is measured.
  * Push phase: 16 asyncio pushers (--pushers) sharing one aiohttp session POST
    the bodies to /scored_data; every answer must be 200.
    Result: groups/s, from the first send to the last response.
  * Drain phase: one trainer loop GETs /batch until N x group-size sequences have
    arrived; every batch must hold exactly 64 sequences (--batch-size); a null
    batch means "sleep 5 ms and retry"; gives up after --drain-timeout seconds.
    Result: sequences/s. The client's own JSON decoding of the answers is inside
    that time (as for a real trainer) and is shown separately. The client accepts
    gzip answers, as aiohttp and `requests` do by default (--identity-responses
    turns that off).

Servers (each started as a subprocess on a free 127.0.0.1 port, torn down after):
  * Lachesis, durable mode (the default of `lachesis api`):
        <this python> -m lachesis.cli api --host 127.0.0.1 --port P --db TMP/queue.sqlite
    and, with --lachesis-in-memory, an extra row with `--in-memory` instead of --db.
  * Atropos (atroposlib 0.4.0's trajectory API, i.e. what `run-api` starts):
        ATROPOS_PY -m uvicorn atroposlib.api:app --host 127.0.0.1 --port P --log-level warning
    ATROPOS_PY is --atropos-python, else $ATROPOS_PYTHON, else
    .bench-venvs/atropos/bin/python under the repo root. atroposlib lives in its
    own venv because its pins clash with this project's; --setup-atropos creates
    it (python3 -m venv + pip install atroposlib==0.4.0). Without it, Atropos is
    skipped and only Lachesis numbers are shown.

The target is Lachesis (durable) >= 10x Atropos on both push and drain.

Run, from the repo root, with the project's Python (it must import aiohttp and
run `lachesis.cli`):
    python benchmarks/api_throughput.py                       # both servers
    python benchmarks/api_throughput.py --setup-atropos       # create the Atropos venv first
    python benchmarks/api_throughput.py --only atropos --groups 400 --json out.json
"""

import argparse
import asyncio
import gzip
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ATROPOS_VENV = REPO_ROOT / ".bench-venvs" / "atropos"
ATROPOS_REQUIREMENT = "atroposlib==0.4.0"

PROMPT_LEN = 200  # positions masked with -100 (the "prompt") in every sequence
VOCAB_SIZE = 151_936  # token ids are drawn from [0, VOCAB_SIZE)
TARGET_RATIO = 10.0
NULL_BATCH_SLEEP_S = 0.005


# --------------------------------------------------------------------------- #
# Workload
# --------------------------------------------------------------------------- #


def make_group(rng, group_size, seq_len):
    """One Atropos ScoredData group as a plain dict."""
    tokens, masks = [], []
    for _ in range(group_size):
        seq = [rng.randrange(VOCAB_SIZE) for _ in range(seq_len)]
        prompt = min(PROMPT_LEN, seq_len)
        tokens.append(seq)
        masks.append([-100] * prompt + seq[prompt:])
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": [round(rng.uniform(-1.0, 1.0), 4) for _ in range(group_size)],
        "group_id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
    }


def build_bodies(n_groups, group_size, seq_len, seed, use_gzip):
    """Encode every request body once, before any timing."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(n_groups):
        body = json.dumps(make_group(rng, group_size, seq_len), separators=(",", ":"))
        body = body.encode()
        if use_gzip:
            body = gzip.compress(body, compresslevel=6)
        bodies.append(body)
    return bodies


def registration_body(batch_size, seq_len):
    return {
        "wandb_group": "bench",
        "wandb_project": "bench",
        "batch_size": batch_size,
        "max_token_len": seq_len,
        "checkpoint_dir": "/tmp/x",
        "save_checkpoint_interval": 0,
        "starting_step": 0,
        "num_steps": 1000,
    }


# --------------------------------------------------------------------------- #
# Atropos venv
# --------------------------------------------------------------------------- #


def atroposlib_import_error(python):
    """Return None if `python` can import atroposlib's API, else the error's last line."""
    result = subprocess.run(
        [str(python), "-c", "import atroposlib.api, uvicorn"],
        check=False,
        capture_output=True,
        text=True,
    )
    if result.returncode == 0:
        return None
    return (result.stderr.strip().splitlines() or ["unknown error"])[-1]


def setup_atropos_venv(venv_dir):
    """Create venv_dir with atroposlib 0.4.0 in it (skipped if already there)."""
    python = venv_dir / "bin" / "python"
    if python.exists() and atroposlib_import_error(python) is None:
        print(f"Atropos venv already set up: {venv_dir}")
        return
    base_python = shutil.which("python3") or sys.executable
    print(f"Creating {venv_dir} with {ATROPOS_REQUIREMENT} (~1 GB, about a minute)")
    started = time.perf_counter()
    subprocess.run([base_python, "-m", "venv", str(venv_dir)], check=True)
    pip_install = [str(python), "-m", "pip", "install", "--quiet", ATROPOS_REQUIREMENT]
    subprocess.run(pip_install, check=True)
    print(f"Atropos venv ready in {time.perf_counter() - started:.0f} s: {python}")


def find_atropos_python(flag_value):
    """Return (python path, "") or (None, the reason none is usable)."""
    if flag_value:
        candidate, source = Path(flag_value), "--atropos-python"
    elif os.environ.get("ATROPOS_PYTHON"):
        candidate, source = Path(os.environ["ATROPOS_PYTHON"]), "$ATROPOS_PYTHON"
    else:
        candidate, source = DEFAULT_ATROPOS_VENV / "bin" / "python", "default venv"
        if not candidate.exists():
            return None, (
                f"no --atropos-python, no $ATROPOS_PYTHON and no {candidate} "
                f"(run with --setup-atropos to create it)"
            )
    if not candidate.exists():
        return None, f"{source} points at {candidate}, which does not exist"
    error = atroposlib_import_error(candidate)
    if error is not None:
        return None, f"{candidate} ({source}) cannot import atroposlib.api: {error}"
    return candidate, ""


# --------------------------------------------------------------------------- #
# Server processes
# --------------------------------------------------------------------------- #


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(kind, port, tmpdir, atropos_python):
    if kind == "atropos":
        return [
            str(atropos_python),
            "-m",
            "uvicorn",
            "atroposlib.api:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
    command = [
        sys.executable,
        "-m",
        "lachesis.cli",
        "api",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if kind == "lachesis-in-memory":
        return command + ["--in-memory"]
    return command + ["--db", str(Path(tmpdir) / "queue.sqlite")]


def start_server(command, log_path):
    with open(log_path, "wb") as log:
        # Own session, so stop_server can end the server and anything it forked.
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def stop_server(proc):
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def log_tail(log_path, lines=20):
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


async def wait_until_up(session, base_url, proc, timeout_s):
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with code {proc.returncode} before answering"
            )
        try:
            async with session.get(f"{base_url}/status") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"GET /status did not answer 200 within {timeout_s:.0f} s")


# --------------------------------------------------------------------------- #
# Phases
# --------------------------------------------------------------------------- #


async def push_phase(session, base_url, bodies, n_pushers, use_gzip):
    """POST every body to /scored_data with n_pushers concurrent tasks; return seconds."""
    headers = {"Content-Type": "application/json"}
    if use_gzip:
        headers["Content-Encoding"] = "gzip"
    next_body = iter(bodies)

    async def pusher():
        for body in next_body:  # the iterator is shared: each body is sent once
            async with session.post(
                f"{base_url}/scored_data", data=body, headers=headers
            ) as resp:
                answer = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(
                        f"POST /scored_data answered {resp.status}: {answer[:300]!r}"
                    )

    started = time.perf_counter()
    await asyncio.gather(*(pusher() for _ in range(n_pushers)))
    return time.perf_counter() - started


async def drain_phase(session, base_url, expected_sequences, batch_size, timeout_s):
    """GET /batch until expected_sequences arrived.

    Returns (seconds, batches, null polls, seconds of those spent decoding and
    checking answers in this client, which the drain total includes).
    """
    received = batches = null_polls = 0
    client_s = 0.0
    started = time.perf_counter()
    while received < expected_sequences:
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(
                f"drain timed out after {timeout_s:.0f} s: got {received} of "
                f"{expected_sequences} sequences in {batches} batches"
            )
        async with session.get(f"{base_url}/batch") as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET /batch answered {resp.status}: {raw[:300]!r}")
        decode_started = time.perf_counter()
        answer = json.loads(raw)
        if answer.get("status") == "error":
            raise RuntimeError(f"GET /batch returned an error: {answer}")
        batch = answer.get("batch")
        if not batch:
            client_s += time.perf_counter() - decode_started
            null_polls += 1
            await asyncio.sleep(NULL_BATCH_SLEEP_S)
            continue
        sequences = sum(len(group["tokens"]) for group in batch)
        if sequences != batch_size:
            raise RuntimeError(
                f"batch {batches + 1} holds {sequences} sequences, not {batch_size}"
            )
        received += sequences
        batches += 1
        client_s += time.perf_counter() - decode_started
    elapsed = time.perf_counter() - started
    if received != expected_sequences:
        raise RuntimeError(
            f"received {received} sequences, expected {expected_sequences}"
        )
    return elapsed, batches, null_polls, client_s


async def bench_server(kind, command, bodies, args, log_path):
    """Start one server, run both phases against it, stop it. Returns a result dict."""
    base_url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    proc = start_server(command, log_path)
    connector = aiohttp.TCPConnector(limit=max(args.pushers, 1) + 4)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # By default aiohttp (like `requests`) accepts gzip answers, and Atropos then
    # gzips every /batch answer; --identity-responses turns that off.
    headers = {"Accept-Encoding": "identity"} if args.identity_responses else None
    try:
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=headers
        ) as session:
            await wait_until_up(session, base_url, proc, args.startup_timeout)
            async with session.post(
                f"{base_url}/register",
                json=registration_body(args.batch_size, args.seq_len),
            ) as resp:
                if resp.status != 200:
                    raise RuntimeError(
                        f"POST /register answered {resp.status}: {await resp.text()}"
                    )
            if kind == "atropos":
                # Atropos trainers poll once first: that sets the server's `started`
                # flag (which gates /register-env) and answers a null batch.
                async with session.get(f"{base_url}/batch") as resp:
                    await resp.read()

            push_s = await push_phase(
                session, base_url, bodies, args.pushers, args.gzip
            )
            expected = args.groups * args.group_size
            drain_s, n_batches, null_polls, client_s = await drain_phase(
                session, base_url, expected, args.batch_size, args.drain_timeout
            )
    except Exception as exc:
        tail = log_tail(log_path)
        raise RuntimeError(
            f"{exc or type(exc).__name__}"
            + (f"\n--- server log (tail) ---\n{tail}" if tail else "")
        ) from exc
    finally:
        stop_server(proc)
    return {
        "push_seconds": push_s,
        "push_groups_per_s": args.groups / push_s,
        "drain_seconds": drain_s,
        "drain_sequences_per_s": expected / drain_s,
        "batches": n_batches,
        "null_batch_polls": null_polls,
        "drain_client_decode_seconds": client_s,
    }


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def print_report(results, not_run):
    print()
    print(f"{'server':<20} | {'push groups/s':>14} | {'drain sequences/s':>18}")
    print(f"{'-' * 20}-+-{'-' * 14}-+-{'-' * 18}")
    for kind, r in results.items():
        print(
            f"{kind:<20} | {r['push_groups_per_s']:>14.1f} | {r['drain_sequences_per_s']:>18.1f}"
        )
    for kind, reason in not_run.items():
        print(f"{kind:<20} | not measured: {reason}")

    ratios = compute_ratios(results)
    if ratios:
        print()
        for kind, ratio in ratios.items():
            print(
                f"{kind} / atropos: push {ratio['push']:.1f}x, drain {ratio['drain']:.1f}x"
            )
    met = target_met(ratios)
    if met is not None:
        verdict = "MET" if met else "NOT met"
        print(
            f"Target (lachesis durable >= {TARGET_RATIO:.0f}x atropos on push and drain): {verdict}"
        )
    return ratios, met


def compute_ratios(results):
    if "atropos" not in results:
        return {}
    base = results["atropos"]
    return {
        kind: {
            "push": r["push_groups_per_s"] / base["push_groups_per_s"],
            "drain": r["drain_sequences_per_s"] / base["drain_sequences_per_s"],
        }
        for kind, r in results.items()
        if kind != "atropos"
    }


def target_met(ratios):
    durable = ratios.get("lachesis")
    if durable is None:
        return None
    return durable["push"] >= TARGET_RATIO and durable["drain"] >= TARGET_RATIO


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Push/drain throughput of the Lachesis and Atropos trajectory APIs.",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=200,
        help="groups pushed (documented range 200-400)",
    )
    parser.add_argument("--group-size", type=int, default=8, help="sequences per group")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--pushers", type=int, default=16, help="concurrent pushers")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="trainer batch size, in sequences"
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="random seed of the workload"
    )
    parser.add_argument(
        "--gzip",
        action="store_true",
        help="send gzip-compressed bodies (Content-Encoding: gzip)",
    )
    parser.add_argument(
        "--identity-responses",
        action="store_true",
        help="send Accept-Encoding: identity, so servers do not gzip /batch answers",
    )
    parser.add_argument(
        "--only", choices=["lachesis", "atropos"], help="benchmark one server only"
    )
    parser.add_argument(
        "--lachesis-in-memory",
        action="store_true",
        help="also report Lachesis started with --in-memory (extra row)",
    )
    parser.add_argument(
        "--atropos-python",
        help="python of a venv with atroposlib 0.4.0 "
        "(default: $ATROPOS_PYTHON, then .bench-venvs/atropos/bin/python)",
    )
    parser.add_argument(
        "--setup-atropos",
        action="store_true",
        help=f"create .bench-venvs/atropos with {ATROPOS_REQUIREMENT} first, then run",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for GET /status",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="seconds before the drain gives up",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, help="seconds per HTTP request"
    )
    parser.add_argument(
        "--json", metavar="OUT", help="also write the numbers as JSON to OUT"
    )
    args = parser.parse_args(argv)
    if args.groups * args.group_size % args.batch_size != 0:
        parser.error(
            "groups x group-size must be a multiple of batch-size, or the drain can never finish"
        )
    if args.batch_size % args.group_size != 0:
        parser.error("batch-size must be a multiple of group-size")
    return args


def main(argv=None):
    args = parse_args(argv)

    kinds = []
    if args.only != "atropos":
        kinds.append("lachesis")
        if args.lachesis_in_memory:
            kinds.append("lachesis-in-memory")
    skipped = {}
    atropos_python = None
    if args.only != "lachesis":
        if args.setup_atropos:
            setup_atropos_venv(DEFAULT_ATROPOS_VENV)
        atropos_python, reason = find_atropos_python(args.atropos_python)
        if atropos_python is None:
            print(f"Atropos skipped: {reason}")
            skipped["atropos"] = reason
        else:
            kinds.append("atropos")
    if not kinds:
        print("Nothing to benchmark.")
        return 1

    bodies = build_bodies(
        args.groups, args.group_size, args.seq_len, args.seed, args.gzip
    )
    megabytes = sum(len(b) for b in bodies) / 1e6
    print(
        f"Workload: {args.groups} groups x {args.group_size} seqs x {args.seq_len} tokens, "
        f"{args.pushers} pushers, batch size {args.batch_size}; "
        f"{megabytes:.1f} MB of {'gzipped ' if args.gzip else ''}request bodies"
    )

    results, failed = {}, {}
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-") as tmpdir:
            command = server_command(kind, free_port(), tmpdir, atropos_python)
            print(f"[{kind}] {' '.join(command)}", flush=True)
            try:
                result = asyncio.run(
                    bench_server(
                        kind, command, bodies, args, Path(tmpdir) / "server.log"
                    )
                )
            except RuntimeError as exc:
                print(f"[{kind}] FAILED: {exc}", flush=True)
                failed[kind] = str(exc).splitlines()[0]
                continue
        print(
            f"[{kind}] push {result['push_seconds']:.2f} s, drain {result['drain_seconds']:.2f} s "
            f"({result['batches']} batches, {result['null_batch_polls']} null polls, "
            f"{result['drain_client_decode_seconds']:.2f} s of the drain decoding in this client)",
            flush=True,
        )
        results[kind] = result

    ratios, met = print_report(results, {**skipped, **failed})

    if args.json:
        report = {
            "workload": {
                "groups": args.groups,
                "group_size": args.group_size,
                "seq_len": args.seq_len,
                "pushers": args.pushers,
                "batch_size": args.batch_size,
                "seed": args.seed,
                "gzip": args.gzip,
                "identity_responses": args.identity_responses,
                "request_megabytes": round(megabytes, 2),
            },
            "results": results,
            "skipped": skipped,
            "failed": failed,
            "ratios_vs_atropos": ratios,
            "target_ratio": TARGET_RATIO,
            "target_met": met,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
