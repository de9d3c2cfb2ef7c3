"""How `lachesis report` scales: a 200 MB JSONL, and a 1,000-group page in Chromium.

    python benchmarks/report_scale.py                  # 200 MB, 1,000-group page load
    python benchmarks/report_scale.py --mb 50 --skip-browser

1. Generates a JSONL of realistic groups (8 trajectories of ~600 tokens: chat messages,
   per-turn scores and spans, vLLM-style full-precision logprobs, flags) of ``--mb`` MB.
2. Runs ``lachesis report`` on it in a child process and reports the wall time and the
   child's peak RSS, next to the peak RSS of a child that only imports the same modules
   (the interpreter and libraries), so the difference is what the report itself held.
3. Writes a report embedding 1,000 groups (``--max-groups 1000``, no size limit) and
   times it in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright):
   navigation until the group list is rendered, then opening a group.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
WORDS = ["lachesis", "atropos", "clotho", "spindle", "thread", "loom", "weave", "distaff"]


def trajectory(rng: random.Random, word: str, target_tokens: int = 600) -> dict:
    """A reverse-the-word style episode: tool turns, then an answer, ~target_tokens."""
    prompt = (f"<|im_start|>system\nYou can call tools.<|im_end|>\n<|im_start|>user\nSpell "
              f"{word!r} backwards: call the reverse tool, then answer.<|im_end|>\n"
              "<|im_start|>assistant\n")
    tokens = list(prompt.encode())
    masks, logprobs = [-100] * len(tokens), [1.0] * len(tokens)
    messages = [{"role": "user", "content": f"Spell {word!r} backwards."}]
    spans, scores = [], []
    n_turns = rng.choice([1, 2, 2, 3, 3, 4])
    for k in range(n_turns):
        last = k == n_turns - 1
        filler = " ".join(rng.choice(WORDS) for _ in range(target_tokens // (9 * n_turns)))
        text = (f"Thinking: {filler}. <answer>{word[::-1] if rng.random() < 0.5 else word}"
                "</answer>" if last else
                f'Thinking: {filler}. <tool_call>{{"name": "reverse", "arguments": '
                f'{{"text": "{word}"}}}}</tool_call>')
        ids = list(text.encode()) + [257]
        start = len(tokens)
        tokens += ids
        masks += ids
        logprobs += [-rng.random() * 3 for _ in ids]
        spans.append([start, len(tokens)])
        messages.append({"role": "assistant", "content": text})
        scores.append(float(f"<answer>{word[::-1]}</answer>" in text) if last
                      else rng.choice([0.5, 1.0]))
        if not last:
            result = word[::-1] if rng.random() < 0.85 else "Error: bad arguments"
            messages.append({"role": "tool", "name": "reverse", "content": result})
            ids = list(f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n".encode())
            tokens += ids
            masks += [-100] * len(ids)
            logprobs += [1.0] * len(ids)
    return {"tokens": tokens, "masks": masks, "scores": scores, "inference_logprobs": logprobs,
            "turn_spans": spans, "messages": messages, "policy_version": rng.randint(0, 5),
            "flags": {"truncated": rng.random() < 0.05,
                      "tool_errors": int(rng.random() < 0.1), "trainable": True},
            "metadata": {"stop": "answer"}}


def generate(path: Path, megabytes: float, group_size: int = 8, seed: int = 0) -> int:
    """Write groups until the file reaches ``megabytes``; return the number of groups.

    A pool of distinct trajectories is built once and recombined (fresh ids and scores
    per group), so generating 200 MB takes seconds."""
    rng = random.Random(seed)
    pool = [trajectory(rng, rng.choice(WORDS)) for _ in range(64)]
    target, written, groups = megabytes * 1e6, 0, 0
    with path.open("wb") as f:
        while written < target:
            members = rng.sample(pool, group_size)
            line = orjson.dumps({"group_id": uuid.UUID(int=rng.getrandbits(128)).hex,
                                 "env": "reverse_word", "item_id": str(groups % 97),
                                 "trajectories": members}) + b"\n"
            f.write(line)
            written += len(line)
            groups += 1
    return groups


CHILD = """
import json, resource, sys, time
from environments.inspection.html_report import write_report
if sys.argv[1] != "imports-only":
    started = time.perf_counter()
    result = write_report(sys.argv[1], sys.argv[2], max_groups=int(sys.argv[3]),
                          max_mb=float(sys.argv[4]))
    print(json.dumps({**result.as_dict(), "wall_s": time.perf_counter() - started,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
else:
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_child(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=REPO, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout)


def browser_load(report: Path, runs: int = 3) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        loads, full_loads, opens = [], [], []
        for _ in range(runs):
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            started = time.perf_counter()
            page.goto(report.resolve().as_uri(), wait_until="commit")
            page.wait_for_function("document.querySelectorAll('#list tbody tr').length > 0",
                                   polling=10)
            loads.append(time.perf_counter() - started)
            page.wait_for_load_state("load")
            full_loads.append(time.perf_counter() - started)
            rows = page.locator("#list tbody tr").count()
            started = time.perf_counter()
            page.locator("#list tbody tr").nth(rows // 2).click()
            page.wait_for_selector(".member .turnbadge")
            opens.append(time.perf_counter() - started)
            page.close()
        browser.close()
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    return {"rows": rows, "list_rendered_s": median(loads), "load_event_s": median(full_loads),
            "open_group_s": median(opens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=200.0, help="size of the JSONL to generate")
    parser.add_argument("--dir", type=Path, default=Path("runs/bench-report"))
    parser.add_argument("--skip-browser", action="store_true")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    big = args.dir / "big.jsonl"

    started = time.perf_counter()
    n_groups = generate(big, args.mb)
    print(f"generated {big}: {big.stat().st_size / 1e6:.1f} MB, {n_groups} groups of 8 "
          f"in {time.perf_counter() - started:.1f} s", flush=True)

    baseline = run_child("imports-only")
    result = run_child(str(big), str(args.dir / "big.html"), "1000", "100")  # the defaults
    print(f"report of {big.stat().st_size / 1e6:.0f} MB: {result['wall_s']:.1f} s, "
          f"embedded {result['embedded']} of {result['groups']} groups "
          f"({result['selection']}), page {result['report_bytes'] / 1e6:.1f} MB; peak RSS "
          f"{result['peak_rss_mb']:.0f} MB (imports alone: {baseline['peak_rss_mb']:.0f} MB)",
          flush=True)

    if args.skip_browser:
        return
    thousand = run_child(str(big), str(args.dir / "thousand.html"), "1000", "1e9")
    assert thousand["embedded"] == min(1000, n_groups), thousand
    timing = browser_load(args.dir / "thousand.html")
    print(f"page of {thousand['embedded']} groups ({thousand['report_bytes'] / 1e6:.1f} MB) "
          f"in headless Chromium: list of {timing['rows']} groups rendered in "
          f"{timing['list_rendered_s']:.2f} s (load event at {timing['load_event_s']:.2f} s), "
          f"a group opened in {timing['open_group_s']:.2f} s (medians of 3)")


if __name__ == "__main__":
    main()
