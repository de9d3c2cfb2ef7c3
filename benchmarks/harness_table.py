"""The harness table: each catalog harness, installed as shipped, run end to end through
the interception proxy on vLLM, its groups checked and trained on.

For each harness (``--harness``, default all ten, and the variants: openai-agents a
second time in its Chat Completions mode, Hermes Agent in its Responses and Anthropic
Messages modes, Kimi Code in its Responses mode: fourteen rows): ``lachesis env process answer_file`` with ``agent:
NAME`` and ``script: true`` (one group of ``--group-size`` rollouts in bwrap
sandboxes): the harness starts as shipped, its model calls reach the proxy in its own
wire API, the proxy forces a two-turn episode (a call of the harness's shell tool writing
42 to answer.txt, which the harness runs in the sandbox, then an answer; vLLM records the
policy's own logprobs of those tokens), the harness reaches its own end, and the file is
graded host-side. Then, on all the groups together, ``lachesis train --check`` (the
trainer recomputes every recorded token's logprob) and one training step
(``lachesis train --data ... --steps 1``).

The model is a tiny random one with a tokenizer learned on the harnesses' captured requests
(tests/fixtures/harness_requests; their first prompts are 0.3k-18k tokens with it) and a
32k context. Harnesses run ``--parallel`` at a time against one vLLM server. Prints one
row per harness and, with ``--json``, writes the rows.

    python benchmarks/harness_table.py                         # every row, groups of 2
    python benchmarks/harness_table.py --harness pi codex --group-size 1 --json rows.json
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

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import yaml  # noqa: E402

from environments.blackbox.harnesses import HARNESSES, install  # noqa: E402
from environments.jsonl_store import read_groups  # noqa: E402

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "harness_requests"
MAX_MODEL_LEN = 32768
VARIANTS = {
    "openai-agents-chat": ("openai-agents", {"OPENAI_AGENTS_API": "chat_completions"}, "chat"),
    "hermes-responses": ("hermes", {"HERMES_API_MODE": "codex_responses"}, "responses"),
    "hermes-messages": ("hermes", {"HERMES_API_MODE": "anthropic_messages"}, "messages"),
    "kimi-code-responses": ("kimi-code", {"KIMI_MODEL_PROVIDER_TYPE": "openai_responses"},
                            "responses")}
"""Rows besides one per harness: (harness, ``agent_env``, wire API): openai-agents in its
Chat Completions mode (the catalog's default is the Responses API), Hermes Agent in its
Responses and Anthropic Messages modes (its default: Chat Completions), Kimi Code in its
Responses mode (its default here: Chat Completions)."""
ROWS = [*HARNESSES, *VARIANTS]


def row_agent(row: str) -> tuple[str, dict[str, str]]:
    name, agent_env, _ = VARIANTS.get(row, (row, {}, None))
    return name, agent_env


def row_wire_api(row: str) -> str:
    """The wire API a row's harness speaks."""
    return VARIANTS[row][2] if row in VARIANTS else HARNESSES[row].wire_api


async def run_harness(label: str, model: Path, server_url: str, work: Path, group_size: int,
                      timeout_s: float, settings: dict | None = None) -> dict:
    """``lachesis env process answer_file`` with the row's ``agent``; the row's facts."""
    name, agent_env = row_agent(label)
    folder = work / label
    folder.mkdir()
    config = folder / "env.yaml"
    config.write_text(yaml.safe_dump({
        "tokenizer": str(model), "inference_servers": [server_url], "agent": name,
        "agent_env": agent_env,
        "script": True, "group_size": group_size, "max_token_length": MAX_MODEL_LEN - 512,
        "max_tokens_per_turn": 256, "agent_timeout_s": timeout_s, "concurrency": group_size,
        "sandbox_backend": "bwrap", "spool_path": str(folder / "spool.jsonl"),
        **(settings or {})}))
    out = folder / "groups.jsonl"
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lachesis.cli", "env", "process", "answer_file", "--config",
        str(config), "--out", str(out), "--groups", "1", "--log-level", "WARNING",
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = await process.communicate()
    row = {"harness": label, "version": HARNESSES[name].version,
           "wire_api": row_wire_api(label),
           "exit": process.returncode,
           "seconds": round(time.monotonic() - started, 1), "out": str(out),
           "stderr_tail": stderr.decode(errors="replace")[-1500:]}
    groups = list(read_groups(out)) if out.exists() else []
    trajectories = [t for g in groups for t in g.trajectories]
    row["rollouts"] = len(trajectories)
    row["turns"] = [len(t.turn_spans) for t in trajectories]
    row["first_prompt_tokens"] = [t.turn_spans[0][0] if t.turn_spans else None
                                  for t in trajectories]
    row["tool_results"] = [sum(m.role == "tool" for m in t.messages) for t in trajectories]
    row["segments"] = [1 + len(t.segment_starts or []) for t in trajectories]
    row["solved"] = [t.scores[-1] == 1.0 for t in trajectories]
    row["wire_apis"] = sorted({api for t in trajectories
                               for api in t.metadata.get("wire_apis", [])})
    row["reached_end"] = [t.metadata.get("agent", {}).get("exit_code") == 0
                          for t in trajectories]
    return row


def trainer(model: Path, data: Path, run_dir: Path, batch_size: int, *extra: str
            ) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lachesis.cli", "train", "--model", str(model), "--data",
         str(data), "--batch-size", str(batch_size), "--run-dir", str(run_dir),
         "--tensorboard", "false", "--log-level", "WARNING", *extra],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


async def table(names: list[str], group_size: int, parallel: int, timeout_s: float,
                work: Path, settings: dict | None = None) -> dict:
    from environments.inference.vllm_process import VLLMProcess
    from lachesis.tiny_model import make_tiny_model

    from concurrent.futures import ThreadPoolExecutor

    harnesses = sorted({row_agent(name)[0] for name in names})
    with ThreadPoolExecutor(len(harnesses)) as pool:  # (cached: once per machine; the
        # downloads overlap: 2.1 GB for all six)
        list(pool.map(lambda name: install(HARNESSES[name], log=lambda message: print(
            message, file=sys.stderr)), harnesses))
    model = make_tiny_model(work / "tiny", tied=True, tokenizer="corpus", corpus=[FIXTURES],
                            vocab_size=8192, max_position_embeddings=MAX_MODEL_LEN)
    with VLLMProcess(model, max_model_len=MAX_MODEL_LEN, kv_cache_space_gib=2,
                     served_model_name="tiny") as server:
        gate = asyncio.Semaphore(parallel)

        async def one(name: str) -> dict:
            async with gate:
                return await run_harness(name, model, server.url, work, group_size, timeout_s,
                                         settings)

        rows = await asyncio.gather(*(one(name) for name in names))
    data = work / "all.jsonl"
    with data.open("w") as out:
        for row in rows:
            if Path(row["out"]).exists():
                out.write(Path(row["out"]).read_text())
    n = sum(row["rollouts"] for row in rows)
    check = trainer(model, data, work / "check", n, "--check")
    step = trainer(model, data, work / "step", n, "--steps", "1")
    summary = {"rows": rows, "sequences": n, "check_exit": check.returncode,
               "check": check.stdout[-3000:] + check.stderr[-2000:],
               "step_exit": step.returncode, "step": step.stdout[-2000:] + step.stderr[-2000:]}
    return summary


def print_table(summary: dict) -> None:
    print("| harness (version) | wire API | rollouts | turns | tool results | segments | "
          "answer.txt right | harness exit 0 | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in summary["rows"]:
        print(f"| {r['harness']} ({r['version']}) | {r['wire_api']} "
              f"({', '.join(r['wire_apis']) or '-'}) | {r['rollouts']} | {r['turns']} | "
              f"{r['tool_results']} | {r['segments']} | {sum(r['solved'])}/{r['rollouts']} | "
              f"{sum(r['reached_end'])}/{r['rollouts']} | {r['seconds']} |")
    print(f"\nlachesis train --check on the {summary['sequences']} sequences: exit "
          f"{summary['check_exit']}; one training step: exit {summary['step_exit']}")
    for r in summary["rows"]:
        if r["exit"] != 0 or not r["rollouts"]:
            print(f"\n{r['harness']}: lachesis env process exited {r['exit']}:\n"
                  f"{r['stderr_tail']}")
    if summary["check_exit"] or summary["step_exit"]:
        print(f"\ncheck:\n{summary['check']}\nstep:\n{summary['step']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", nargs="+", default=ROWS, choices=ROWS,
                        help="rows: a catalog harness, or a variant: "
                        f"{', '.join(VARIANTS)}")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--work", type=Path, help="where the groups go (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the rows and results here")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="env settings over the table's (a YAML value each), e.g. "
                        "harness_compaction=true max_token_length=20000")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="harness-table-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = {key: yaml.safe_load(value) for key, value in
                (item.split("=", 1) for item in args.set)}
    summary = asyncio.run(table(args.harness, args.group_size, args.parallel, args.timeout_s,
                                work, settings))
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    ok = summary["check_exit"] == 0 and summary["step_exit"] == 0 and all(
        r["exit"] == 0 and r["rollouts"] and all(r["solved"]) and all(r["reached_end"])
        for r in summary["rows"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
