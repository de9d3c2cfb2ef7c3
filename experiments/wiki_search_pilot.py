"""Study 4's pilot (issue 76): ``wiki_search`` on SmolLM2-135M-Instruct, before any
registration. What an RL step costs at each horizon, whether GRPO-OR learns from a warm
start, where the warm start's tool-call rate lies, and a first look at the run-to-run
spread of the final metric.

    python experiments/wiki_search_pilot.py --lock /tmp/lachesis-heavy.lock --one  # next cell
    python experiments/wiki_search_pilot.py --status                              # what is done
    python experiments/wiki_search_pilot.py --report                              # the table

Cells, in order (``CELLS``); each is finished once its ``summary.json`` is under
``--results`` (tracked in git), so the script resumes where it stopped, and every attempt
appends a line to ``RESULTS/manifest.jsonl`` (commit, dirty tree, the packages' hash with
the list under ``packages/``, the full config, seconds, outcome; ``confirmatory.attempt``):

1. ``warm-start/NAME``: an SFT of SmolLM2-135M-Instruct (the packaged model) on
   demonstrations (``WARM_STARTS[NAME]``), half one-hop and half two-hop training items (the
   env's ``oracle_messages``), of which the share ``DIRECT_FRACTION``
   (``oracle_direct_fraction``) answer at once without a search: the warm start keeps
   "not invoking the tool" among its habits. The weights stay under ``--runs-dir`` (538 MB,
   not tracked); their sha256 is kept.
2. ``warm-start-eval/NAME``: the warm start plays every held-out item of each horizon once at
   temperature 1 (as RL samples), on a vLLM of its own: tool-call rate (with a 95 % Wilson
   interval) against ``BAND``, exact match, and the other rates of
   ``wiki_search_probe.probe``.
3. ``rl/HORIZON/ARM-seedS``: ``lachesis run`` of the RL phase from the warm start
   (``rl_config``: groups of 8, 2 groups a step, ``STEPS`` steps, lr ``LR``), held-out
   evaluation after (not before: cell 2 measured the start) at temperature 1 over every
   held-out item. Kept: the summary, the trainer's per-step metrics, and per-episode rates
   of the evaluations.

The second pilot (``--pilot 2``, ``PILOT2``) measures the run-to-run spread before the
registration: ``warm-start-rebuild/NAME`` makes the warm start's weights again where they
are missing (its hash kept beside the first build's), then ``pilot2/one_hop/ARM-seedS``,
GRPO-OR and MT-GRPO interleaved, seeds 3-5, ``PILOT2_STEPS`` steps, every held-out item
evaluated ``EVAL_SAMPLES`` times (the env's ``eval_samples``; rates and intervals over
items), the start measured by the first run of each arm.

    python experiments/wiki_search_pilot.py --pilot 2 --one     # its next cell

``--report`` prints the pilot's numbers as JSON (and writes ``RESULTS/report.json``): per
horizon, the seconds per RL step (the mean after the first step, which also waits for the
first rollouts), the trained tokens per step, the evaluations before and after, and the
final exact match and tool-call rate of each run; under ``second_pilot``, each run's final
metrics and, per arm, their run-to-run sd (also printed as a table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

import confirmatory as cf  # noqa: E402
import stress as st  # noqa: E402
import wiki_search_probe as wsp  # noqa: E402
from stats import wilson  # noqa: E402
from venv_pin import packages  # noqa: E402

from environments.framework.evaluation import item_interval  # noqa: E402
from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import Supervisor, run_quietly  # noqa: E402

RESULTS = REPO / "experiments" / "results" / "wiki-search-pilot"
MODEL = "smollm2-135m-instruct"
HORIZONS = ("one_hop", "two_hop")
DIRECT_FRACTION = 0.3
BAND = (0.3, 0.9)
"""The warm start's held-out tool-call rate (temperature 1, each horizon) must lie in this
band: at least 3 in 10 episodes call the tool, so that RL has the tool route to reinforce,
and at least 1 in 10 do not, so that "not invoking the tool" can still happen."""
_SFT = {"batch_size": 8, "micro_batch_size": 8, "lr": 8.0e-5, "max_token_length": 2048,
        "dtype": "auto", "tensorboard": False, "seed": 1}
WARM_STARTS = {
    # the first try: its held-out tool-call rate fell under the band (the policy wrote
    # {"name": NAME, ...}, the system prompt's placeholder, in many calls)
    "sft24": {"demonstrations": 192, "train": {**_SFT, "steps": 24, "warmup_steps": 3}},
    "sft64": {"demonstrations": 512, "train": {**_SFT, "steps": 64, "warmup_steps": 4}},
}
"""SFTs (demonstrations: half of each horizon; the SFT trainer's settings)."""
WARM_START = "sft64"
"""The warm start the RL cells start from."""
STEPS = 6  # the pilot had ~70 min of the heavy lock, shared with other sessions
LR = 4.0e-5  # configs/smollm2.yaml's RL rate for this model
MAX_BATCH_WAIT_S = 300
ARMS = {
    "grpo": ({"estimator": "grpo"}, {"outcome_only": True}),
    "grpo_merged": ({"estimator": "grpo_merged"}, {}),
    "mt_grpo": ({"estimator": "mt_grpo"}, {}),
    "mt_grpo_unbiased": ({"estimator": "mt_grpo_unbiased"}, {}),
}
CELLS = [f"warm-start/{WARM_START}", f"warm-start-eval/{WARM_START}",
         "rl/one_hop/grpo-seed1", "rl/two_hop/grpo-seed1",
         "rl/one_hop/grpo-seed2", "rl/two_hop/grpo-seed2"]
"""The pilot's cells in the order they run; ``--cell`` runs another (e.g.
``rl/one_hop/mt_grpo-seed1``)."""
PILOT2_STEPS = 32
EVAL_SAMPLES = 4
"""The second pilot's held-out evaluations play every item this many times."""
PILOT2_ARMS = ("grpo", "mt_grpo")
PILOT2_SEEDS = (3, 4, 5)
PILOT2 = [f"warm-start-rebuild/{WARM_START}"] + [
    f"pilot2/one_hop/{arm}-seed{seed}" for seed in PILOT2_SEEDS for arm in PILOT2_ARMS] + [
    f"pilot2/two_hop/mt_grpo-seed{PILOT2_SEEDS[0]}"]
"""The second pilot (``--pilot 2``): the run-to-run spread of the final metrics at one hop,
GRPO-OR and MT-GRPO, 3 runs each of ``PILOT2_STEPS`` steps from the same warm start,
interleaved (a partial pilot stays balanced); the first run of each arm also measures the
start. Its first cell rebuilds the warm start's weights where they are missing; its last
is one MT-GRPO run at two hops, the start measured too: what a 32-step two-hop run costs
with an arm that keeps searching (the first pilot's GRPO-OR runs stopped calling the tool
there, which made their episodes short), and whether exact match leaves the floor."""
PILOTS = {1: CELLS, 2: PILOT2}


# --- the warm start --------------------------------------------------------------------------

def env_settings(horizon: str, **more: Any) -> dict[str, Any]:
    return {"horizon": horizon, "group_size": 8, "max_turns": 4, "max_tokens_per_turn": 64,
            "max_token_length": 2048, "temperature": 1.0, "eval_temperature": 1.0,
            "eval_items": 64, "max_queued_groups": 4, **more}


def warm_start_config(runs_dir: Path, name: str) -> RunConfig:
    return RunConfig.model_validate({
        "name": f"warm-start-{name}", "runs_dir": str(runs_dir), "model": MODEL,
        "warm_start": {"env": "wiki_search", **WARM_STARTS[name],
                       "settings": {"seed": 1, "oracle_direct_fraction": DIRECT_FRACTION}},
        "vllm": {"max_model_len": 2048, "kv_cache_gib": 1, "dtype": "auto"},
        "envs": [{"name": "wiki_search", "settings": env_settings("one_hop")}],
        "train": {"steps": 1}})


class MixedWarmStart(Supervisor):
    """``prepare_model`` with demonstrations of both horizons, half each, interleaved
    (the run config's warm start names one env's settings, so one horizon)."""

    def write_demonstrations(self, path: Path, tokenizer: str) -> Path:
        from environments.envs.wiki_search import WikiSearchConfig, WikiSearchEnv

        ws = self.config.warm_start
        rows: list[list[str]] = []
        direct = 0
        for horizon in HORIZONS:
            env = WikiSearchEnv(WikiSearchConfig(**{**ws.settings, "horizon": horizon,
                                                    "tokenizer": tokenizer}))
            asyncio.run(env.setup())
            tools = [t.schema() for t in env.tools]
            lines = []
            for _ in range(ws.demonstrations // 2):
                messages = env.oracle_messages(asyncio.run(env.get_next_item()))
                direct += not any(m["role"] == "tool" for m in messages)
                lines.append(json.dumps({"messages": messages, "tools": tools}))
            rows.append(lines)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(a + "\n" + b + "\n" for a, b in zip(*rows)))
        tmp.rename(path)
        about = {"demonstrations": ws.demonstrations, "answered_at_once": direct,
                 "oracle_direct_fraction": DIRECT_FRACTION}
        path.with_name("demonstrator.json").write_text(json.dumps(about, indent=1))
        self.say(f"warm start: the demonstrator: {json.dumps(about)}")
        return path


def warm_start_path(runs_dir: Path, name: str) -> Path:
    return runs_dir / f"warm-start-{name}" / "warm_start" / "final"


def run_warm_start(runs_dir: Path, name: str) -> dict[str, Any]:
    config = warm_start_config(runs_dir, name)
    config.check_sections()
    if config.run_dir.exists():
        shutil.rmtree(config.run_dir)
    config.run_dir.mkdir(parents=True)
    began = time.monotonic()
    supervisor = MixedWarmStart(config, live=False)
    try:
        final = supervisor.prepare_model()
    finally:
        supervisor.stop_all()
    sft = config.run_dir / "warm_start"
    losses = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()
              if line.strip()] if (sft / "metrics.jsonl").exists() else []
    return {"final": final, "sha256": cf.weights_hash(final),
            "seconds": round(time.monotonic() - began, 1),
            "demonstrator": json.loads((sft / "demonstrator.json").read_text()),
            "sft_steps": [{k: r[k] for k in ("step", "loss", "step_seconds", "row_tokens")
                           if k in r} for r in losses]}


def recorded_hashes(results: Path, name: str) -> list[str]:
    """The kept hashes of the warm start's weights: the first build's, then a rebuild's
    (``warm-start-rebuild/NAME``) where one was kept."""
    kept = [results / "warm-start" / name, results / "warm-start-rebuild" / name]
    return [json.loads((k / "summary.json").read_text())["sha256"] for k in kept
            if (k / "summary.json").exists()]


def the_warm_start(runs_dir: Path, results: Path, name: str) -> tuple[str, str]:
    """The warm start's weights and hash, checked against the kept summaries'."""
    recorded = recorded_hashes(results, name)
    model = warm_start_path(runs_dir, name)
    digest = cf.weights_hash(str(model)) if model.exists() else None
    if digest not in recorded:
        raise SystemExit(f"the warm start under {model} has hash {digest} (recorded "
                         f"{', '.join(h[:12] for h in recorded)}): rebuild it with "
                         f"--cell warm-start-rebuild/{name}")
    return str(model), digest


def warm_start_ready(runs_dir: Path, results: Path, name: str) -> bool:
    model = warm_start_path(runs_dir, name)
    return model.exists() and cf.weights_hash(str(model)) in recorded_hashes(results, name)


def rebuild_warm_start(runs_dir: Path, results: Path, name: str) -> dict[str, Any]:
    """The warm start's SFT again (its weights live outside git): the same config, so the
    same weights where the SFT is deterministic; the hash says whether it is."""
    found = run_warm_start(runs_dir, name)
    first = json.loads((results / "warm-start" / name / "summary.json").read_text())["sha256"]
    return {**found, "first_build_sha256": first, "same_as_first_build": found["sha256"] == first}


RATES = ("tool_calls", "tool_success", "answer_in_result", "exact_match", "direct_answer",
         "bridge_in_result")


def by_item(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    items: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        items.setdefault(row["item_id"], []).append(row)
    return items


def rates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rates of an evaluation's episodes (``wsp.episodes`` rows). One sample per item: the
    share of episodes and its Wilson interval. Several (``eval_samples``): the mean over
    items of each item's share of its samples, the interval over the item shares (the
    samples of one item are not independent), as the env's ``evaluate`` reports."""
    n = len(rows)
    items = by_item(rows)
    clustered = any(len(samples) > 1 for samples in items.values())
    out: dict[str, Any] = {"episodes": n, **({"items": len(items)} if clustered else {})}
    for key in RATES:
        name = "tool_call_rate" if key == "tool_calls" else key
        if clustered:
            shares = [sum(r["metrics"].get(key, 0.0) > 0 for r in samples) / len(samples)
                      for samples in items.values()]
            out[name] = round(statistics.mean(shares), 4)
            out[f"{name}_ci95"] = [round(x, 4) for x in item_interval(shares, rate=True)]
            continue
        hits = sum(r["metrics"].get(key, 0.0) > 0 for r in rows)
        out[name] = round(hits / n, 4) if n else None
        out[f"{name}_ci95"] = [round(x, 4) for x in wilson(hits, n)[1:]] if n else None
    out["mean_turns"] = round(sum(r["turns"] for r in rows) / n, 3) if n else None
    out["mean_sampled_tokens"] = round(sum(r["sampled"] for r in rows) / n, 1) if n else None
    return out


def attempt_rate(path: Path) -> float:
    """The share of an evaluation's episodes with a ``<tool_call>`` written in a reply,
    well-formed or not (``tool_call_rate`` counts the calls that parsed)."""
    groups = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    episodes = [t for g in groups for t in g["trajectories"]]
    return round(sum(any("<tool_call>" in m["content"] for m in t.get("messages") or []
                         if m["role"] == "assistant") for t in episodes) / len(episodes), 4)


def evaluate_warm_start(runs_dir: Path, results: Path, name: str) -> dict[str, Any]:
    from environments.inference.vllm_process import VLLMProcess

    model, digest = the_warm_start(runs_dir, results, name)
    out = runs_dir / f"warm-start-eval-{name}"
    out.mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {"warm_start_sha256": digest, "band": list(BAND)}
    began = time.monotonic()
    with VLLMProcess(model, max_model_len=4096, log_path=out / "vllm.log") as server:
        for horizon in HORIZONS:
            path = out / f"{horizon}.jsonl"
            path.unlink(missing_ok=True)
            probe = asyncio.run(wsp.probe(server.url, model, horizon, 1.0, 64, 64, path, None))
            found[horizon] = {**probe, **rates(wsp.episodes(path)),
                              "call_attempt_rate": attempt_rate(path)}
            low, high = found[horizon]["tool_call_rate_ci95"]
            found[horizon]["in_band"] = BAND[0] <= found[horizon]["tool_call_rate"] <= BAND[1]
            found[horizon]["interval_in_band"] = BAND[0] <= low and high <= BAND[1]
    found["seconds"] = round(time.monotonic() - began, 1)
    return found


# --- RL -----------------------------------------------------------------------------------

def parse_cell(cell: str) -> tuple[str, str, int]:
    _, horizon, rest = cell.split("/")
    arm, _, seed = rest.rpartition("-seed")
    if horizon not in HORIZONS or arm not in ARMS:
        raise SystemExit(f"unknown cell {cell}: rl/HORIZON/ARM-seedS with HORIZON in "
                         f"{HORIZONS} and ARM in {list(ARMS)}")
    return horizon, arm, int(seed)


def rl_config(runs_dir: Path, model: str, cell: str, steps: int, lr: float,
              evaluate_before: bool, eval_samples: int = 1) -> RunConfig:
    horizon, arm, seed = parse_cell(cell)
    trainer, env = ARMS[arm]
    if eval_samples > 1:
        env = {**env, "eval_samples": eval_samples}
    return RunConfig.model_validate({
        "name": cell.replace("/", "-"), "runs_dir": str(runs_dir), "model": model,
        "evaluate_before": evaluate_before,
        "api": {"max_staleness": 2},
        "vllm": {"max_model_len": 2048, "kv_cache_gib": 1, "dtype": "auto"},
        "envs": [{"name": "wiki_search",
                  "settings": env_settings(horizon, seed=1000 + seed, **env)}],
        "train": {**trainer, "steps": steps, "batch_size": 16, "micro_batch_size": 16,
                  "max_token_length": 2048, "lr": lr, "warmup_steps": 2, "dtype": "auto",
                  "checkpoint_every": steps, "tensorboard": False, "seed": seed,
                  "max_batch_wait_s": MAX_BATCH_WAIT_S}})


def keep_rl(run_dir: Path, kept: Path, summary: dict[str, Any]) -> None:
    """The run's summary, per-step metrics and the evaluations' per-episode rates into
    ``kept``; the summary last, by rename."""
    (kept / "trainer").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run_dir / "trainer" / "metrics.jsonl", kept / "trainer" / "metrics.jsonl")
    for label in ("before", "after"):
        path = run_dir / "eval" / f"{label}-wiki_search.jsonl"
        if path.exists():
            rows = wsp.episodes(path)
            summary[f"{label}_rates"] = {**rates(rows), "call_attempt_rate": attempt_rate(path)}
            if any(len(samples) > 1 for samples in by_item(rows).values()):
                # per item: [samples, then the samples with each rate's event]
                summary[f"{label}_per_item"] = {
                    item: [len(samples), *(sum(r["metrics"].get(k, 0.0) > 0 for r in samples)
                                           for k in RATES)]
                    for item, samples in by_item(rows).items()}
                summary[f"{label}_per_item_columns"] = ["samples", *RATES]
    done = kept / "summary.json"
    done.with_suffix(".tmp").write_text(json.dumps(summary, indent=2, default=str))
    done.with_suffix(".tmp").rename(done)


# --- the cells ---------------------------------------------------------------------------------

def entry_for(results: Path, cell: str) -> dict[str, Any]:
    text, digest = packages()
    listing = results / "packages" / f"{digest}.txt"
    if not listing.exists():
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text(text)
    return {"cell": cell, **cf.git_state(ignore=results), "packages_sha256": digest,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def finished(results: Path, cell: str) -> bool:
    return (results / cell / "summary.json").exists()


def done(args: argparse.Namespace, cell: str) -> bool:
    """A cell is done once its summary is kept; a rebuild of the warm start once its
    weights are there with a kept hash."""
    stage, _, name = cell.partition("/")
    if stage == "warm-start-rebuild":
        return warm_start_ready(args.runs_dir, args.results, name)
    return finished(args.results, cell)


def keep_json(kept: Path, value: dict[str, Any]) -> None:
    kept.mkdir(parents=True, exist_ok=True)
    done = kept / "summary.json"
    done.with_suffix(".tmp").write_text(json.dumps(value, indent=2, default=str))
    done.with_suffix(".tmp").rename(done)


def run_cell(args: argparse.Namespace, cell: str) -> str:
    results = args.results
    entry = entry_for(results, cell)
    stage, _, name = cell.partition("/")
    if stage == "warm-start":
        entry["config"] = warm_start_config(args.runs_dir, name).model_dump(mode="json")
        return cf.attempt(results, entry, lambda: _locked(args, lambda: run_warm_start(
            args.runs_dir, name)), lambda found: keep_json(results / cell, found))
    if stage == "warm-start-rebuild":
        entry["config"] = warm_start_config(args.runs_dir, name).model_dump(mode="json")
        return cf.attempt(results, entry, lambda: _locked(args, lambda: rebuild_warm_start(
            args.runs_dir, results, name)), lambda found: keep_json(results / cell, found))
    model, digest = the_warm_start(args.runs_dir, results, WARM_START)
    if stage == "pilot2":
        # the first run of each arm measures the start too, with the same evaluation
        _, _, seed = parse_cell(cell)
        config = rl_config(args.runs_dir, model, cell, args.steps or PILOT2_STEPS, args.lr,
                           evaluate_before=seed == PILOT2_SEEDS[0], eval_samples=EVAL_SAMPLES)
    else:
        # the starting policy is measured by the warm-start-eval cell (the same items and
        # temperature): no evaluation before RL
        config = rl_config(args.runs_dir, model, cell, args.steps or STEPS, args.lr,
                           evaluate_before=False)
    entry.update(warm_start_sha256=digest, config=config.model_dump(mode="json"))
    return cf.attempt(results, entry, lambda: _locked(args, lambda: run_quietly(config)),
                      lambda summary: keep_rl(config.run_dir, results / cell, summary))


def _locked(args: argparse.Namespace, work: Any) -> Any:
    with cf.held(args.lock):
        return work()


# --- the report ----------------------------------------------------------------------------

def report(results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in WARM_STARTS:
        if finished(results, f"warm-start/{name}"):
            ws = json.loads((results / "warm-start" / name / "summary.json").read_text())
            row = out.setdefault("warm_starts", {}).setdefault(name, {})
            row.update({k: ws[k] for k in ("sha256", "seconds", "demonstrator")})
            steps = ws.get("sft_steps", [])
            if steps:
                row["sft_first_last_loss"] = [steps[0].get("loss"), steps[-1].get("loss")]
        if finished(results, f"warm-start-eval/{name}"):
            found = json.loads((results / "warm-start-eval" / name / "summary.json").read_text())
            out["warm_starts"][name]["eval"] = {h: {k: found[h][k] for k in (
                "episodes", "tool_call_rate", "tool_call_rate_ci95", "tool_success",
                "exact_match", "exact_match_ci95", "direct_answer", "answer_in_result",
                "mean_turns", "call_attempt_rate", "in_band") if k in found[h]}
                for h in HORIZONS if h in found}
    for horizon in HORIZONS:
        cells = sorted(p.parent for p in (results / "rl" / horizon).glob("*/summary.json"))
        rows = {}
        for kept in cells:
            summary = json.loads((kept / "summary.json").read_text())
            metrics = [json.loads(line) for line in
                       (kept / "trainer" / "metrics.jsonl").read_text().splitlines() if line]
            later = metrics[1:] or metrics
            row = {"steps": len(metrics), "run_seconds": round(summary["seconds"], 1),
                   "seconds_per_step_after_the_first": round(statistics.mean(
                       m["step_seconds"] for m in later), 1) if later else None,
                   "trained_tokens_per_step": round(statistics.mean(
                       m["trained_tokens"] for m in metrics if "trained_tokens" in m), 0)
                   if any("trained_tokens" in m for m in metrics) else None,
                   "row_tokens_per_step": round(statistics.mean(
                       m["row_tokens"] for m in metrics if "row_tokens" in m), 0)
                   if any("row_tokens" in m for m in metrics) else None,
                   "generation_seconds_per_rollout": round(statistics.mean(
                       m["env/time/generation"] for m in metrics
                       if "env/time/generation" in m), 2)
                   if any("env/time/generation" in m for m in metrics) else None,
                   **{f"batch_{k}_per_step": [round(m[f"env/{k}"], 3) for m in metrics
                                              if f"env/{k}" in m]
                      for k in ("tool_calls", "exact_match")},
                   "reward_mean_per_step": [round(m["reward_mean"], 3) for m in metrics
                                            if "reward_mean" in m]}
            for label in ("before", "after"):
                found = summary.get(f"{label}_rates")
                if found:
                    row[label] = {k: found[k] for k in ("episodes", "tool_call_rate",
                                                        "exact_match", "exact_match_ci95",
                                                        "tool_success", "direct_answer",
                                                        "mean_turns")}
            rows[kept.name] = row
        finals = [r["after"]["exact_match"] for r in rows.values() if "after" in r]
        out[horizon] = {"runs": rows}
        if len(finals) >= 2:
            out[horizon]["final_exact_match_sd"] = round(statistics.stdev(finals), 4)
    for key, horizon in (("second_pilot", "one_hop"), ("second_pilot_two_hop", "two_hop")):
        second = second_pilot(results, horizon)
        if second["runs"]:
            out[key] = second
    (results / "report.json").write_text(json.dumps(out, indent=1))
    return out


FINAL = ("exact_match", "tool_success", "tool_call_rate")
"""The second pilot's final metrics (held-out, ``EVAL_SAMPLES`` samples per item)."""


def evaluation_se(summary: dict[str, Any], label: str, metric: str
                  ) -> tuple[float, float | None] | None:
    """Two standard errors of an evaluation's rate, from its per-item counts: over items
    (the sd of the item shares over the square root of the items: the noise of drawing
    the items, which the interval reports), and within items (``sqrt(sum_i p_i (1 - p_i)
    / (k_i - 1)) / n``: the sampling noise alone, on these items; what a run-to-run sd
    on the same items contains of the evaluation's noise)."""
    per_item = summary.get(f"{label}_per_item")
    if not per_item:
        return None
    column = summary[f"{label}_per_item_columns"].index(
        "tool_calls" if metric == "tool_call_rate" else metric)
    shares = [(row[column] / row[0], row[0]) for row in per_item.values()]
    n = len(shares)
    within = (sum(p * (1 - p) / (k - 1) for p, k in shares) ** 0.5 / n
              if all(k > 1 for _, k in shares) else None)
    return (round(statistics.stdev(p for p, _ in shares) / n ** 0.5, 4),
            None if within is None else round(within, 4))


def second_pilot(results: Path, horizon: str = "one_hop") -> dict[str, Any]:
    """At ``horizon``, per run, the start (where measured) and final metrics with their
    intervals over items; per arm, each final metric's values, mean and run-to-run sd
    (n - 1 df); the sd pooled over the arms."""
    runs: dict[str, Any] = {}
    for path in sorted((results / "pilot2" / horizon).glob("*/summary.json")):
        summary = json.loads(path.read_text())
        arm, _, seed = path.parent.name.rpartition("-seed")
        metrics = [json.loads(line) for line in (path.parent / "trainer" / "metrics.jsonl")
                   .read_text().splitlines() if line]
        later = metrics[1:] or metrics
        row: dict[str, Any] = {
            "arm": arm, "seed": int(seed), "steps": len(metrics),
            "run_seconds": round(summary["seconds"], 1),
            "seconds_per_step_after_the_first": round(statistics.mean(
                m["step_seconds"] for m in later), 1) if later else None,
            "batch_exact_match_per_step": [round(m["env/exact_match"], 3) for m in metrics
                                           if "env/exact_match" in m]}
        for label, key in (("start", "before"), ("final", "after")):
            found = summary.get(f"{key}_rates")
            if found:
                row[label] = {k: found.get(k) for k in ("items", "episodes")}
                for metric in (*FINAL, "direct_answer"):
                    row[label][metric] = found[metric]
                    row[label][f"{metric}_ci95"] = found[f"{metric}_ci95"]
                    se = evaluation_se(summary, key, metric) if metric in FINAL else None
                    if se is not None:
                        row[label][f"{metric}_se"], row[label][f"{metric}_se_within"] = se
        runs[path.parent.name] = row
    arms: dict[str, Any] = {}
    for arm in PILOT2_ARMS:
        finals = [r["final"] for r in runs.values() if r["arm"] == arm and "final" in r]
        if finals:
            arms[arm] = {"runs": len(finals), **{metric: {
                "values": [f[metric] for f in finals],
                "mean": round(statistics.mean(f[metric] for f in finals), 4),
                "sd": round(statistics.stdev(f[metric] for f in finals), 4)
                if len(finals) >= 2 else None, "df": len(finals) - 1,
                **{f"mean_evaluation_{se}": round(statistics.mean(
                    f[f"{metric}_{se}"] for f in finals), 4)
                   if all(f.get(f"{metric}_{se}") is not None for f in finals) else None
                   for se in ("se", "se_within")}}
                for metric in FINAL}}
    pooled = {}
    for metric in FINAL:
        spread = [a[metric] for a in arms.values() if a[metric]["df"] >= 1]
        df = sum(a["df"] for a in spread)
        if df:
            pooled[metric] = {"sd": round((sum(a["df"] * a["sd"] ** 2 for a in spread)
                                           / df) ** 0.5, 4), "df": df}
    rebuilt = results / "warm-start-rebuild" / WARM_START / "summary.json"
    warm = json.loads(rebuilt.read_text()) if rebuilt.exists() else None
    return {"steps": PILOT2_STEPS, "eval_samples": EVAL_SAMPLES, "lr": LR,
            "warm_start": WARM_START, "warm_start_rebuilt": {
                k: warm[k] for k in ("sha256", "same_as_first_build", "seconds")}
            if warm else None, "runs": runs, "arms": arms, "pooled_sd": pooled}


def second_pilot_table(found: dict[str, Any]) -> str:
    """The second pilot as markdown: a row per run, then the run-to-run sd per arm."""
    def cell(values: dict[str, Any], metric: str) -> str:
        low, high = values[f"{metric}_ci95"]
        return f"{values[metric]:.3f} [{low:.2f}, {high:.2f}]"

    lines = ["| arm | run | steps | s/step | start: exact match | final: exact match [95 % CI] "
             "| final: tool success [95 % CI] | final: tool-call rate [95 % CI] |",
             "|---|---|---:|---:|---|---|---|---|"]
    for name, row in found["runs"].items():
        start = row.get("start")
        final = row.get("final")
        lines.append(f"| {row['arm']} | seed {row['seed']} | {row['steps']} | "
                     f"{row['seconds_per_step_after_the_first']} | "
                     f"{cell(start, 'exact_match') if start else ''} | "
                     + (" | ".join(cell(final, m) for m in FINAL) if final else " | ")
                     + " |")
    lines += ["", "| arm | runs | " + " | ".join(
        f"final {m}: mean, run-to-run sd (df), evaluation se over items / within items"
        for m in FINAL) + " |", "|---|---:|" + "---|" * len(FINAL)]
    for arm, values in found["arms"].items():
        lines.append(f"| {arm} | {values['runs']} | " + " | ".join(
            f"{values[m]['mean']:.3f}, {values[m]['sd'] if values[m]['sd'] is not None else '-'}"
            f" ({values[m]['df']}), {values[m]['mean_evaluation_se']} / "
            f"{values[m]['mean_evaluation_se_within']}" for m in FINAL) + " |")
    if found["pooled_sd"]:
        lines += ["", "sd pooled over the arms: " + ", ".join(
            f"{metric} {pooled['sd']} ({pooled['df']} df)"
            for metric, pooled in found["pooled_sd"].items())]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "wiki-search-pilot",
                        help="where runs work (weights, checkpoints, logs; not kept)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where finished cells and the manifest are kept (tracked)")
    parser.add_argument("--lock", type=Path, default=None,
                        help="a file locked (flock) around each cell, e.g. "
                        "/tmp/lachesis-heavy.lock (leave out when the caller holds it)")
    parser.add_argument("--one", action="store_true", help="run the next cell only")
    parser.add_argument("--cell", help="run this cell (e.g. rl/one_hop/mt_grpo-seed1)")
    parser.add_argument("--pilot", type=int, choices=sorted(PILOTS), default=1,
                        help="which pilot's cells --one, --status and a plain run take: 1 "
                        "(the first: warm starts, GRPO-OR at both horizons, 6 steps) or 2 "
                        "(one hop, GRPO-OR and MT-GRPO, 3 runs each of 32 steps, "
                        f"{EVAL_SAMPLES} evaluation samples per item)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"RL steps (default: {STEPS} in the first pilot, "
                        f"{PILOT2_STEPS} in the second)")
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--status", action="store_true")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    cells = PILOTS[args.pilot]
    args.cells = cells + ([args.cell] if args.cell and args.cell not in cells else [])
    if args.report:
        found = report(args.results)
        print(json.dumps(found, indent=1))
        for key, horizon in (("second_pilot", "one hop"), ("second_pilot_two_hop", "two hops")):
            if key in found:
                print(f"\nsecond pilot, {horizon}:\n" + second_pilot_table(found[key]))
        return 0
    todo = [c for c in ([args.cell] if args.cell else cells) if not done(args, c)]
    if args.status:
        for cell in args.cells:
            print(f"{cell}: {'finished' if done(args, cell) else 'to do'}")
        return 0
    st.stop_on_sigterm()  # `timeout` ends a cell like Ctrl-C: processes stopped, recorded
    for cell in todo[:1] if args.one else todo:
        print(f"{cell}: {run_cell(args, cell)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
