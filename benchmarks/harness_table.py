"""The harness table: each catalog harness, installed as shipped, run end to end through
the interception proxy on vLLM, its groups checked and trained on.

For each harness (``--harness``, default all eleven, and the variants: openai-agents a
second time in its Chat Completions mode, Hermes Agent in its Responses and Anthropic
Messages modes, Kimi Code in its Responses mode: fifteen rows): ``lachesis env process answer_file`` with ``agent:
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

With a model that speaks (``--model``: a HF checkpoint dir or a packaged model's name,
e.g. the smollm2 config's warm start), its context (``max_position_embeddings``, at most
32k) bounds the prompts, vLLM and the trainer run in ``--dtype`` (``auto``: bfloat16 on a
CPU with AMX-BF16 or AVX512-BF16), ``--unforced`` lets the model sample every turn
itself (``script: false``: the rows count what it did, they are not expected to solve),
and ``--fitting`` keeps only the harnesses whose first request fits in that context
(each harness's first captured request, tests/fixtures/harness_requests, its whole JSON
body in the model's tokenizer: the counts are printed first; ``--count-only`` prints them
and stops):

    python benchmarks/harness_table.py --model runs/smollm2/warm_start/final --unforced \
        --fitting --group-size 2 --json rows.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import yaml  # noqa: E402

from environments.blackbox.harness_cache import install  # noqa: E402
from environments.blackbox.harnesses import HARNESSES  # noqa: E402
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
FIRST_REQUEST = {"openai-agents": "openai-agents-responses",
                 "openai-agents-chat": "openai-agents-chat"}
"""The fixture directory of a row's first request (others: the row's own name)."""
MAX_TOKENS_PER_TURN = 256
EPISODE = {"aider": (1, 0)}
"""(turns, tool results) of a row's scripted episode where not (2, 1): Aider makes no
tool calls; its one reply writes answer.txt in its edit format, then it exits."""
SEGMENTS = {"openclaw": 2}
"""Segments of a row's two-turn episode where not one: OpenClaw re-sends its runtime
context (a user message) at the end of every request, so its second request does not
extend the first (tests/fixtures/harness_requests/openclaw)."""


def model_context(model: str) -> int:
    """The model's context (``max_position_embeddings``), at most :data:`MAX_MODEL_LEN`."""
    config = json.loads((Path(model) / "config.json").read_text())
    return min(int(config.get("max_position_embeddings", MAX_MODEL_LEN)), MAX_MODEL_LEN)


def first_request_tokens(tokenizer: str, rows: list[str]) -> dict[str, int]:
    """Each row's first captured request (its whole JSON body) in ``tokenizer``'s tokens:
    a rough size of the harness's first prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    out = {}
    for row in rows:
        for file in sorted((FIXTURES / FIRST_REQUEST.get(row, row)).glob("*.json")):
            request = json.loads(file.read_text())
            if request.get("method") == "HEAD" or not request.get("body"):
                continue
            body = request["body"]
            text = body if isinstance(body, str) else json.dumps(body)
            out[row] = len(tok(text, add_special_tokens=False)["input_ids"])
            break
    return out


def row_agent(row: str) -> tuple[str, dict[str, str]]:
    name, agent_env, _ = VARIANTS.get(row, (row, {}, None))
    return name, agent_env


def row_wire_api(row: str) -> str:
    """The wire API a row's harness speaks."""
    return VARIANTS[row][2] if row in VARIANTS else HARNESSES[row].wire_api


async def run_harness(label: str, model: Path, server_url: str, work: Path, group_size: int,
                      timeout_s: float, max_model_len: int = MAX_MODEL_LEN,
                      script: bool = True, settings: dict | None = None) -> dict:
    """``lachesis env process answer_file`` with the row's ``agent``; the row's facts."""
    name, agent_env = row_agent(label)
    folder = work / label
    folder.mkdir()
    config = folder / "env.yaml"
    config.write_text(yaml.safe_dump({
        "tokenizer": str(model), "inference_servers": [server_url], "agent": name,
        "agent_env": agent_env,
        "script": script, "group_size": group_size, "max_token_length": max_model_len - 512,
        "max_tokens_per_turn": MAX_TOKENS_PER_TURN, "agent_timeout_s": timeout_s,
        "concurrency": group_size,
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
                work: Path, model: str | None = None, dtype: str = "float32",
                script: bool = True, settings: dict | None = None) -> dict:
    """``model``: the policy (None: a tiny random one with a tokenizer learned on the
    captured requests, 32k context); ``dtype``: vLLM's and the trainer's; ``script``:
    force the two-turn episode; ``settings``: env settings over the table's."""
    from environments.inference.vllm_process import VLLMProcess
    from lachesis.tiny_model import make_tiny_model

    from concurrent.futures import ThreadPoolExecutor

    harnesses = sorted({row_agent(name)[0] for name in names})
    with ThreadPoolExecutor(len(harnesses)) as pool:  # (cached: once per machine; the
        # downloads overlap: 2.1 GB for all six)
        list(pool.map(lambda name: install(HARNESSES[name], log=lambda message: print(
            message, file=sys.stderr)), harnesses))
    if model is None:
        model = make_tiny_model(work / "tiny", tied=True, tokenizer="corpus",
                                corpus=[FIXTURES], vocab_size=8192,
                                max_position_embeddings=MAX_MODEL_LEN)
        max_model_len = MAX_MODEL_LEN
    else:
        max_model_len = model_context(model)
    with VLLMProcess(model, max_model_len=max_model_len, kv_cache_space_gib=2,
                     served_model_name="tiny", dtype=dtype) as server:
        gate = asyncio.Semaphore(parallel)

        async def one(name: str) -> dict:
            async with gate:
                return await run_harness(name, model, server.url, work, group_size, timeout_s,
                                         max_model_len, script, settings)

        rows = await asyncio.gather(*(one(name) for name in names))
    data = work / "all.jsonl"
    with data.open("w") as out:
        for row in rows:
            if Path(row["out"]).exists():
                out.write(Path(row["out"]).read_text())
    n = sum(row["rollouts"] for row in rows)
    check = trainer(model, data, work / "check", n, "--check", "--dtype", dtype,
                    "--log-level", "INFO")
    step = trainer(model, data, work / "step", n, "--steps", "1", "--dtype", dtype)
    found = re.search(r"alignment check: mean \|trainer - vLLM\| logprob = (\S+) over (\d+)",
                      check.stderr)
    alignment = {"mean_abs_diff": float(found.group(1)), "tokens": int(found.group(2))} \
        if found else None
    summary = {"rows": rows, "sequences": n, "check_exit": check.returncode,
               "alignment": alignment, "dtype": dtype, "script": script,
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
    alignment = summary.get("alignment")
    print(f"\nlachesis train --check on the {summary['sequences']} sequences: exit "
          f"{summary['check_exit']}" + (f" (mean |trainer - vLLM| logprob "
                                        f"{alignment['mean_abs_diff']:.2e} over "
                                        f"{alignment['tokens']} tokens)" if alignment else "")
          + f"; one training step: exit {summary['step_exit']}")
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
    parser.add_argument("--model", help="the policy: a HF checkpoint dir or a packaged "
                        "model's name (default: a tiny random model, 32k context)")
    parser.add_argument("--dtype", default=None,
                        help="vLLM's and the trainer's dtype (default: float32 for the tiny "
                        "model, auto for --model: bfloat16 on a CPU with AMX-BF16 or "
                        "AVX512-BF16)")
    parser.add_argument("--unforced", action="store_true",
                        help="the model samples every turn (script: false)")
    parser.add_argument("--fitting", action="store_true",
                        help="only the harnesses whose first request fits in the model's "
                        "context (with a turn's tokens)")
    parser.add_argument("--count-only", action="store_true",
                        help="print each harness's first-request tokens, then stop")
    args = parser.parse_args()
    from environments.inference.dtypes import resolve_dtype
    from environments.inference.packaged_models import resolve_model

    model = None
    if args.model is not None:
        model = resolve_model(args.model) if not Path(args.model).exists() \
            else str(Path(args.model).resolve())
    dtype = resolve_dtype(args.dtype or ("auto" if model else "float32"))
    names = args.harness
    if model is not None and (args.fitting or args.count_only):
        context = model_context(model)
        counts = first_request_tokens(model, names)
        print(f"first requests in {model}'s tokenizer (context {context}):")
        for name in names:
            if name not in counts:  # no captured request to count: left out of --fitting
                print(f"  {name}: no captured first request in {FIXTURES} (not counted)")
                continue
            fits = counts[name] + MAX_TOKENS_PER_TURN <= context
            print(f"  {name}: {counts[name]} tokens ({'fits' if fits else 'does not fit'})")
        if args.count_only:
            return
        names = [n for n in names
                 if n in counts and counts[n] + MAX_TOKENS_PER_TURN <= context]
    work = args.work or Path(tempfile.mkdtemp(prefix="harness-table-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = {key: yaml.safe_load(value) for key, value in
                (item.split("=", 1) for item in args.set)}
    summary = asyncio.run(table(names, args.group_size, args.parallel, args.timeout_s,
                                work, model, dtype, script=not args.unforced,
                                settings=settings))
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    solved = args.unforced  # unforced: the rows count what the model did
    ok = summary["check_exit"] == 0 and summary["step_exit"] == 0 and all(
        r["exit"] == 0 and r["rollouts"] and (solved or (all(r["solved"])
                                                         and all(r["reached_end"])))
        for r in summary["rows"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
