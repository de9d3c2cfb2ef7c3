"""Study 4 (docs/study-wiki-search.md, its registration): turn-level credit on MT-GRPO's
search task. Four arms on ``wiki_search`` with SmolLM2-135M-Instruct at two horizons, each
arm at a learning rate a registered rule picked per horizon, across two independently
trained warm starts. Resumable.

    python experiments/wiki_search_credit.py --lock /tmp/lachesis-heavy.lock   # to the end
    python experiments/wiki_search_credit.py --one      # the next cell, then exit
    python experiments/wiki_search_credit.py --status   # counts only, no outcome
    python experiments/wiki_search_credit.py --report   # the registered analysis

Cells, in the order they run:

1. ``warm-starts/tuning``: the tuning warm start, the pilot's ``sft64`` itself (the recipe
   ``RECIPE`` at demonstration and SFT seed ``TUNING_SEED`` = 1, the pilot's config byte
   for byte). It is identified by its weights' sha256: they must be one of the hashes the
   pilot kept (``wiki_search_pilot.recorded_hashes``: ``1d3bbcab…``). Its weights are
   copied from the pilot's runs (``--pilot-runs-dir``, default ``PILOT_RUNS``) where they
   are there with that hash, else rebuilt (the SFT is deterministic: the pilot rebuilt them bit for bit); then it
   is evaluated as every warm start is (below).
2. ``tuning/HORIZON/lrLR/ARM-seed900``: from the tuning warm start, each arm at each rate
   of ``LRS`` at each horizon, one run each (rate outermost, then horizon, then arm).
3. ``tuning-choice.json``: once every tuning cell is settled (finished, or failed
   ``MAX_ATTEMPTS`` times), per arm and horizon the rate with the highest final held-out
   mean outcome score (``after.wiki_search.mean_outcome`` of the run's summary: the env's
   outcome, exact match + answer present + format, averaged over items); ties within
   1e-12 to the smaller rate; no finished run: ``FALLBACK_LR``. Written once, then read.
4. ``warm-starts/seedS``, S = 11, 12, ... (candidate k has seed ``10 + k``): the recipe at
   demonstration and SFT seed S, in order, until ``WARM_STARTS`` of them have a held-out
   tool-call rate inside ``BAND`` at both horizons (at most ``MAX_CANDIDATES`` tried):
   the confirmation warm starts ws1, ws2.
5. ``confirmation/HORIZON/wsK/ARM-seedS``: every arm at its chosen rate, ``RUNS`` runs per
   arm, warm start and horizon, seed ``400 + 10 K + i``; run index outermost, then
   horizon, warm start, arm, so a grid cut short stays balanced.

A warm-start cell is the SFT and then its held-out evaluation at both horizons with the
evaluation every RL run ends with (``evaluate``: every held-out item ``EVAL_SAMPLES`` times
at temperature 1, the env's settings of the runs, vLLM in the runs' dtype), so that a run's
final tool-call rate is comparable with its warm start's. Its weights (~540 MB) stay under
``--runs-dir``; ``RESULTS`` keeps the summary (sha256, evaluation, band, seconds, SFT
losses). An RL cell whose warm start's weights are missing or differ rebuilds them with
the same config and stops (SystemExit naming the cell) if the hash is not the kept one.
An RL run (``wiki_search_pilot.run_config``: the second pilot's run) works under
``--runs-dir``; its summary, per-step metrics and evaluation rates go to ``RESULTS``, and
a cell is finished when its ``summary.json`` is there. Every attempt appends a line to
``RESULTS/manifest.jsonl`` (commit, dirty tree, packages' hash, config, seconds, outcome).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

import confirmatory as cf  # noqa: E402
import stress as st  # noqa: E402
import wiki_search_pilot as wp  # noqa: E402
import wiki_search_probe as wsp  # noqa: E402
from stats import holm, stratified_permutation, t_interval, tost  # noqa: E402

from lachesis.run.config import RunConfig  # noqa: E402
from lachesis.run.supervisor import RunFailed, run_quietly  # noqa: E402

ENV = "wiki_search"
MODEL = wp.MODEL  # the packaged SmolLM2-135M-Instruct, bfloat16 (dtype auto)
# arm -> label, in the registered order (their settings: wiki_search_pilot.ARMS)
ARMS = {"grpo": "GRPO-OR (outcome only)", "grpo_merged": "GRPO-MR (summed turn rewards)",
        "mt_grpo": "MT-GRPO", "mt_grpo_unbiased": "MT-GRPO, unbiased baseline"}
assert tuple(ARMS) == tuple(wp.ARMS)
TURN_ARMS = ("mt_grpo", "mt_grpo_unbiased")
HORIZONS = wp.HORIZONS
RECIPE = "sft64"  # the warm starts' recipe (wiki_search_pilot.WARM_STARTS)
TUNING_SEED = 1  # the pilot's sft64: the tuning warm start
CANDIDATE_SEED = 10  # candidate k: demonstration and SFT seed 10 + k
BAND = wp.BAND  # held-out tool-call rate at temperature 1, at both horizons
WARM_STARTS = 2
MAX_CANDIDATES = 6
LRS = (1e-5, 4e-5, 1.6e-4)
TUNING_RUN_SEED = 900
FALLBACK_LR = 4e-5  # an arm with no finished tuning run at a horizon (configs/smollm2.yaml)
STEPS = wp.PILOT2_STEPS  # 32 steps of 2 groups of 8
RUNS = 3  # confirmation runs per arm, warm start and horizon
EVAL_SAMPLES = wp.EVAL_SAMPLES  # every held-out item this many times, at temperature 1
RESULTS = REPO / "experiments" / "results" / "wiki-search-credit"
PILOT_RUNS = REPO / "runs" / "wiki-search-pilot"  # the pilot's --runs-dir (its sft64)
MAX_ATTEMPTS = cf.MAX_ATTEMPTS
ALPHA = 0.05
MARGIN = 0.08  # equivalence margin on final held-out exact match (TOST)
DRAWS = 100_000
PERMUTATION_SEED = 20261207
FINAL = ("exact_match", "tool_success", "tool_call_rate")


def confirmation_seed(ws: int, i: int) -> int:
    """The ``i``-th run (0..2) from confirmation warm start ``ws`` (1..2)."""
    return 400 + 10 * ws + i


class Design(NamedTuple):
    lrs: tuple[float, ...] = LRS
    horizons: tuple[str, ...] = HORIZONS
    arms: tuple[str, ...] = tuple(ARMS)  # smoke runs: a subset
    steps: int = STEPS  # smoke runs: fewer
    runs: int = RUNS  # smoke runs: fewer

    @property
    def registered(self) -> bool:
        return self == Design()


class Cell(NamedTuple):
    stage: str  # warm-start, tuning, confirmation
    horizon: str  # "" for a warm start (it serves both)
    ws: int  # warm-start: its seed; tuning: 0; confirmation: 1..2
    arm: str | None = None
    seed: int | None = None
    lr: float | None = None

    @property
    def id(self) -> str:
        if self.stage == "warm-start":
            return ("warm-starts/tuning" if self.ws == TUNING_SEED
                    else f"warm-starts/seed{self.ws}")
        if self.stage == "tuning":
            return f"tuning/{self.horizon}/lr{self.lr:g}/{self.arm}-seed{self.seed}"
        return f"confirmation/{self.horizon}/ws{self.ws}/{self.arm}-seed{self.seed}"

    @property
    def group(self) -> str:
        return self.id.rsplit("/", 1)[0]


def warm_start_cell(seed: int) -> Cell:
    return Cell("warm-start", "", seed)


# --- the grid -------------------------------------------------------------------------

def summary_of(results: Path, cell: Cell) -> dict[str, Any] | None:
    path = results / cell.id / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def settled(results: Path, manifest: list[dict[str, Any]], cell: Cell) -> bool:
    return (summary_of(results, cell) is not None or
            st.failures(manifest, cell) >= MAX_ATTEMPTS)


def confirmation_warm_starts(results: Path) -> tuple[list[int], int | None]:
    """The confirmation warm starts (candidate seeds, in order, the first ``WARM_STARTS``
    in band at both horizons) and the next candidate to make (None: none needed, or
    ``MAX_CANDIDATES`` tried). A candidate that failed ``MAX_ATTEMPTS`` times is passed."""
    manifest = cf.read_manifest(results)
    chosen: list[int] = []
    for k in range(1, MAX_CANDIDATES + 1):
        cell = warm_start_cell(CANDIDATE_SEED + k)
        summary = summary_of(results, cell)
        if summary is None:
            if st.failures(manifest, cell) >= MAX_ATTEMPTS:
                continue
            return chosen, cell.ws
        if summary["in_band"]:
            chosen.append(cell.ws)
            if len(chosen) == WARM_STARTS:
                return chosen, None
    return chosen, None


def tuning_cells(design: Design) -> list[Cell]:
    return [Cell("tuning", h, 0, arm, TUNING_RUN_SEED, lr)
            for lr in design.lrs for h in design.horizons for arm in design.arms]


def confirmation_cells(design: Design, chosen: dict[str, dict[str, float]]) -> list[Cell]:
    return [Cell("confirmation", h, ws, arm, confirmation_seed(ws, i), chosen[h][arm])
            for i in range(design.runs) for h in design.horizons
            for ws in range(1, WARM_STARTS + 1) for arm in design.arms]


def mean_outcome(summary: dict[str, Any]) -> float:
    """The run's final held-out mean outcome score, as its evaluation reports it."""
    return float(summary["after"][ENV]["mean_outcome"])


def choose(results: Path, design: Design) -> dict[str, Any]:
    """The registered rule, once: per horizon and arm, the rate whose tuning run ended
    with the highest held-out mean outcome; ties within 1e-12 to the smaller rate; no
    finished run: ``FALLBACK_LR``. Written to ``tuning-choice.json``, from then on read."""
    path = results / "tuning-choice.json"
    if path.exists():
        return json.loads(path.read_text())
    chosen: dict[str, dict[str, float]] = {}
    found: dict[str, dict[str, dict[str, float | None]]] = {}
    for horizon in design.horizons:
        for arm in design.arms:
            rows = {}
            for lr in sorted(design.lrs):
                summary = summary_of(results, Cell("tuning", horizon, 0, arm,
                                                   TUNING_RUN_SEED, lr))
                if summary is not None:
                    rows[lr] = mean_outcome(summary)
                found.setdefault(horizon, {}).setdefault(arm, {})[f"{lr:g}"] = rows.get(lr)
            best = max(rows.values(), default=None)
            chosen.setdefault(horizon, {})[arm] = (
                min(lr for lr, m in rows.items() if m >= best - 1e-12) if rows
                else FALLBACK_LR)
    choice = {"rule": "per arm and horizon, the highest final held-out mean outcome of the "
                      "tuning runs; ties within 1e-12 to the smaller rate; no finished run: "
                      f"{FALLBACK_LR:g}", "chosen": chosen, "mean_outcome": found,
              "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(choice, indent=2))
    path.with_suffix(".tmp").rename(path)
    return choice


def next_cell(results: Path, design: Design) -> Cell | None:
    manifest = cf.read_manifest(results)
    tuning_start = warm_start_cell(TUNING_SEED)
    if not settled(results, manifest, tuning_start):
        return tuning_start
    if summary_of(results, tuning_start):
        for cell in tuning_cells(design):
            if not settled(results, manifest, cell):
                return cell
    chosen = choose(results, design)["chosen"]
    seeds, candidate = confirmation_warm_starts(results)
    if candidate is not None:
        return warm_start_cell(candidate)
    for cell in confirmation_cells(design, chosen):
        if cell.ws <= len(seeds) and not settled(results, manifest, cell):
            return cell
    return None


def progress(results: Path, design: Design) -> str:
    """Counts per stage (no outcome of any run)."""
    manifest = cf.read_manifest(results)
    count = lambda folder: (sum(1 for _ in (results / folder).glob("**/summary.json"))
                            if (results / folder).exists() else 0)
    planned = len(design.horizons) * len(design.arms) * WARM_STARTS * design.runs
    outcomes = {o: sum(e["outcome"] == o for e in manifest) for o in ("failed", "stopped")}
    return (f"warm starts {count('warm-starts')} made, tuning {count('tuning')}/"
            f"{len(tuning_cells(design))}, confirmation {count('confirmation')}/{planned}; "
            f"{len(manifest)} attempts ({outcomes['failed']} failed, "
            f"{outcomes['stopped']} stopped)")


# --- one cell -----------------------------------------------------------------------------

async def _evaluate(env: Any) -> dict[str, Any]:
    await env.start()
    try:
        return await env.evaluate()
    finally:
        await env.close()


def evaluate(model: str, out: Path) -> dict[str, Any]:
    """The policy ``model`` on every held-out item of each horizon, ``EVAL_SAMPLES`` times
    at temperature 1, with the RL runs' env settings and vLLM dtype: per horizon the
    rates of ``wiki_search_pilot.rates`` (means over items, intervals over items), the
    share of episodes that attempted a call, the mean outcome, whether the tool-call
    rate is inside ``BAND``."""
    from environments.envs.wiki_search import WikiSearchConfig, WikiSearchEnv
    from environments.inference.dtypes import resolve_dtype
    from environments.inference.vllm_process import VLLMProcess

    out.mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {}
    began = time.monotonic()
    with VLLMProcess(model, max_model_len=2048, dtype=resolve_dtype("auto"),
                     kv_cache_space_gib=1, log_path=out / "vllm.log") as server:
        for horizon in HORIZONS:
            path = out / f"{horizon}.jsonl"
            path.unlink(missing_ok=True)
            env = WikiSearchEnv(WikiSearchConfig(
                **wp.env_settings(horizon, eval_samples=EVAL_SAMPLES),
                inference_servers=[server.url], tokenizer=model, eval_out=path,
                api_token=None))
            metrics = asyncio.run(_evaluate(env))
            rows = wsp.episodes(path)
            found[horizon] = {**wp.rates(rows), "call_attempt_rate": wp.attempt_rate(path),
                              "mean_outcome": metrics["mean_outcome"],
                              "failed": metrics["failed"], "per_item": wp.per_item(rows),
                              "per_item_columns": ["samples", *wp.RATES]}
            found[horizon]["in_band"] = BAND[0] <= found[horizon]["tool_call_rate"] <= BAND[1]
    found["seconds"] = round(time.monotonic() - began, 1)
    return found


def warm_start_weights(args: argparse.Namespace, seed: int, recorded: list[str],
                       cell: Cell) -> tuple[str, str, dict[str, Any] | None]:
    """The warm start ``seed``'s weights under ``--runs-dir`` and their hash, which must
    be one of ``recorded``. Missing or different: the tuning warm start is copied from the
    pilot's runs where they hold it, any other rebuilt with its config (the SFT's record
    is returned); a hash still not recorded stops the study at ``cell``."""
    model = wp.warm_start_path(args.runs_dir, RECIPE, seed)
    if model.exists() and (digest := cf.weights_hash(str(model))) in recorded:
        return str(model), digest, None
    made = None
    pilot = wp.warm_start_path(getattr(args, "pilot_runs_dir", PILOT_RUNS), RECIPE, seed)
    if seed == TUNING_SEED and pilot.exists() and cf.weights_hash(str(pilot)) in recorded:
        if model.exists():
            shutil.rmtree(model)
        shutil.copytree(pilot, model)
    else:
        made = wp.run_warm_start(args.runs_dir, RECIPE, seed)
    digest = cf.weights_hash(str(model))
    if digest not in recorded:
        raise SystemExit(f"{cell.id}: the warm start seed {seed} rebuilt under {model} has "
                         f"hash {digest[:12]}, not the kept "
                         f"{', '.join(h[:12] for h in recorded)}: stopped")
    return str(model), digest, made


def make_warm_start(args: argparse.Namespace, cell: Cell) -> dict[str, Any]:
    """The SFT (the tuning warm start: the pilot's weights, checked against its hashes),
    then the evaluation. An error on the way is a failed attempt."""
    try:
        if cell.ws == TUNING_SEED:
            pilot = wp.recorded_hashes(wp.RESULTS, RECIPE)
            model, digest, made = warm_start_weights(args, cell.ws, pilot, cell)
            made = made or {k: v for k, v in json.loads(
                (wp.RESULTS / "warm-start" / RECIPE / "summary.json").read_text()).items()
                if k in ("seconds", "demonstrator", "sft_steps")}
        else:
            made = wp.run_warm_start(args.runs_dir, RECIPE, cell.ws)
            model, digest = made["final"], made["sha256"]
        evaluation = evaluate(model, args.runs_dir / f"{wp.warm_start_name(RECIPE, cell.ws)}"
                                                     "-eval")
    except (RunFailed, SystemExit, KeyboardInterrupt):
        raise
    except Exception as error:  # a vLLM that did not come up, an env error
        raise RunFailed(f"{type(error).__name__}: {error}") from error
    return {"seed": cell.ws, "recipe": RECIPE, "sha256": digest,
            "sft_seconds": made.get("seconds"), "demonstrator": made.get("demonstrator"),
            "sft_steps": made.get("sft_steps"), "evaluation_seconds": evaluation.pop("seconds"),
            "evaluation": evaluation, "band": list(BAND),
            "in_band": all(evaluation[h]["in_band"] for h in HORIZONS)}


def warm_start_of(results: Path, cell: Cell) -> Cell:
    """The warm-start cell an RL cell starts from."""
    if cell.stage == "tuning":
        return warm_start_cell(TUNING_SEED)
    seeds, _ = confirmation_warm_starts(results)
    return warm_start_cell(seeds[cell.ws - 1])


MICRO_BATCH_TOKENS = 4096
"""Deviation 1: the token budget of a packed micro-batch in every RL run from it on."""


def rl_config(args: argparse.Namespace, design: Design, cell: Cell, model: str) -> RunConfig:
    """The second pilot's run (``wiki_search_pilot.run_config``) of the cell's arm at its
    horizon, rate and seed; the final evaluation only (the start's is its warm start's)."""
    config = wp.run_config(args.runs_dir / cell.group, f"{cell.arm}-seed{cell.seed}", model,
                           cell.horizon, cell.arm, cell.seed, design.steps, cell.lr,
                           evaluate_before=False, eval_samples=EVAL_SAMPLES)
    # deviation 1 (docs/study-wiki-search.md): packed micro-batches of at most 4096 tokens,
    # not the default 16384 (a batch of 16 long episodes OOM-killed the trainer); the
    # accumulated gradient is the batch's mean either way
    config.train["max_tokens_per_micro_batch"] = MICRO_BATCH_TOKENS
    return config


def run_one(args: argparse.Namespace, design: Design, cell: Cell) -> str:
    entry = {**st.entry_for(args, cell), "horizon": cell.horizon}
    if cell.stage == "warm-start":
        entry["config"] = wp.warm_start_config(args.runs_dir, RECIPE, cell.ws).model_dump(
            mode="json")
        return cf.attempt(args.results, entry, lambda: make_warm_start(args, cell),
                          lambda made: wp.keep_json(args.results / cell.id, made))
    ws_cell = warm_start_of(args.results, cell)
    recorded = [summary_of(args.results, ws_cell)["sha256"]]
    model, digest, _ = warm_start_weights(args, ws_cell.ws, recorded, cell)
    config = rl_config(args, design, cell, model)
    entry.update(warm_start_cell=ws_cell.id, warm_start_sha256=digest,
                 config=config.model_dump(mode="json"))
    # a run's folder (its checkpoints and synced weights: about 1.4 GB; 72 runs would not
    # fit the disk) goes once its files are kept (run_quietly empties it before a run)
    def keep(summary: dict[str, Any]) -> None:
        wp.keep_rl(config.run_dir, args.results / cell.id, summary)
        shutil.rmtree(config.run_dir, ignore_errors=True)

    return cf.attempt(args.results, entry, lambda: run_quietly(config), keep)


def check_design(args: argparse.Namespace, design: Design) -> None:
    """Every config the grid makes is valid before anything runs."""
    chosen = {h: {arm: FALLBACK_LR for arm in design.arms} for h in design.horizons}
    try:
        for seed in (TUNING_SEED, *range(CANDIDATE_SEED + 1, CANDIDATE_SEED + MAX_CANDIDATES
                                         + 1)):
            wp.warm_start_config(args.runs_dir, RECIPE, seed).check_sections()
        for cell in tuning_cells(design) + confirmation_cells(design, chosen):
            rl_config(args, design, cell, "warm-start").check_sections()
    except ValueError as error:
        raise SystemExit(f"wiki search credit study: {error}") from None


# --- the registered analysis ----------------------------------------------------------------

def sign_flip(differences: list[float], *, draws: int = DRAWS, seed: int = PERMUTATION_SEED
              ) -> tuple[float, float]:
    """The mean of paired ``differences`` and its one-sided one-sample permutation p against
    the alternative that the mean is below 0 (the registered prediction: GRPO-OR ends with
    fewer tool calls than its warm start made): under the null each difference is as likely
    to have either sign, so every pattern of signs is equally likely. Exact (all 2^n
    patterns) when 2^n <= ``draws``, ``p = #{mean* <= mean} / 2^n``; else ``draws`` random
    patterns (``random.Random(seed)``), counting the observed one, ``p = (1 + hits) / (1 +
    draws)``. (Two-sided, 6 runs could never pass Holm: its smallest p is 2/64.)"""
    if not differences:
        raise ValueError("sign_flip: no differences")
    n = len(differences)
    observed = sum(differences) / n
    tolerance = 1e-12 * max(1.0, abs(observed))
    if 2 ** n <= draws:
        hits = sum(sum(s * d for s, d in zip(signs, differences)) / n <= observed + tolerance
                   for signs in itertools.product((1, -1), repeat=n))
        return observed, hits / 2 ** n
    rng = random.Random(seed)
    hits = sum(sum(d if rng.random() < 0.5 else -d for d in differences) / n
               <= observed + tolerance for _ in range(draws))
    return observed, (1 + hits) / (1 + draws)


COLUMNS = {"exact_match": "exact_match", "tool_success": "tool_success",
           "tool_call_rate": "tool_calls"}  # a final metric's per-item column


def unrounded(per_item: dict[str, list[int]] | None, columns: list[str] | None,
              metric: str, kept: float) -> float:
    """The rate as registered, not rounded: the mean over items of the item's share of its
    samples, from the kept per-item counts (``kept``, the 4-decimal rate, where there are
    none). The tests use these: rounding would break exact ties between relabellings."""
    if not per_item or not columns:
        return float(kept)
    at = columns.index(COLUMNS[metric])
    return sum(c[at] / c[0] for c in per_item.values()) / len(per_item)


def final_rate(summary: dict[str, Any], metric: str) -> float:
    """A run's final held-out ``metric``, ``unrounded``."""
    return unrounded(summary.get("after_per_item"), summary.get("after_per_item_columns"),
                     metric, summary["after_rates"][metric])


def run_rows(results: Path, design: Design, chosen: dict[str, dict[str, float]]
             ) -> dict[str, dict[str, dict[int, list[dict[str, Any]]]]]:
    """horizon -> arm -> warm start -> finished runs: final held-out exact match, tool
    success, tool-call rate (``unrounded``), and the tool-call rate's change from the run's
    warm start's."""
    rows: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = {}
    for cell in confirmation_cells(design, chosen):
        summary = summary_of(results, cell)
        if summary is None:
            continue
        start = summary_of(results, warm_start_of(results, cell))["evaluation"][cell.horizon]
        row = {m: final_rate(summary, m) for m in FINAL}
        start_rate = unrounded(start.get("per_item"), start.get("per_item_columns"),
                               "tool_call_rate", start["tool_call_rate"])
        row.update(cell=cell.id, start_tool_call_rate=start_rate,
                   tool_call_change=row["tool_call_rate"] - start_rate)
        rows.setdefault(cell.horizon, {}).setdefault(cell.arm, {}).setdefault(
            cell.ws, []).append(row)
    return rows


def strata(values: dict[str, dict[int, list[dict[str, Any]]]], a: str, b: str, key: str
           ) -> tuple[list[list[float]], list[list[float]]]:
    shared = sorted(set(values.get(a, {})) & set(values.get(b, {})))
    return ([[r[key] for r in values[a][ws]] for ws in shared],
            [[r[key] for r in values[b][ws]] for ws in shared])


def registered_tests(rows: dict[str, Any]) -> dict[str, Any]:
    """Primary: per horizon, MT-GRPO against GRPO-OR, final exact match and tool success,
    the permutation test stratified by warm start (two-sided), Holm over the four.
    Secondary, Holm within each family: (a) ``mt_grpo_unbiased`` against GRPO-OR, the same
    metrics; (b) each turn-level arm against GRPO-MR, exact match; (c) GRPO-OR stops
    invoking the tool: its final tool-call rate minus its warm start's (``sign_flip``,
    one-sided: below); (d) GRPO-OR against MT-GRPO in final tool-call rate. Equivalence: TOST of MT-GRPO against
    GRPO-OR in exact match, margin ``MARGIN``, Holm over the horizons."""
    comparisons = {
        "primary": [(h, "mt_grpo", "grpo", m) for h in HORIZONS
                    for m in ("exact_match", "tool_success")],
        "secondary (a): mt_grpo_unbiased vs GRPO-OR": [
            (h, "mt_grpo_unbiased", "grpo", m) for h in HORIZONS
            for m in ("exact_match", "tool_success")],
        "secondary (b): turn-level arms vs GRPO-MR": [
            (h, arm, "grpo_merged", "exact_match") for h in HORIZONS for arm in TURN_ARMS],
        "secondary (c): GRPO-OR stops invoking the tool (one-sided)": [
            (h, "grpo", None, "tool_call_change") for h in HORIZONS],
        "secondary (d): GRPO-OR vs MT-GRPO, tool-call rate": [
            (h, "grpo", "mt_grpo", "tool_call_rate") for h in HORIZONS],
    }
    out: dict[str, Any] = {}
    for family, members in comparisons.items():
        tests = {}
        for horizon, a, b, key in members:
            values = rows.get(horizon, {})
            if b is None:  # one sample: the runs' changes from their warm start
                changes = [r[key] for ws in sorted(values.get(a, {})) for r in values[a][ws]]
                if changes:
                    d, p = sign_flip(changes)
                    tests[f"{horizon}: {a}, final - warm start, tool_call_rate"] = {
                        "difference": d, "p": p, "runs": len(changes)}
                continue
            x, y = strata(values, a, b, key)
            if x:
                d, p = stratified_permutation(x, y, draws=DRAWS, seed=PERMUTATION_SEED)
                tests[f"{horizon}: {a} - {b}, {key}"] = {"difference": d, "p": p,
                                                         "strata": len(x)}
        adjusted = holm({k: t["p"] for k, t in tests.items()})
        out[family] = {k: {**t, "holm": adjusted[k]} for k, t in tests.items()}
    tests = {}
    for horizon in HORIZONS:
        x, y = strata(rows.get(horizon, {}), "mt_grpo", "grpo", "exact_match")
        if x and all(len(v) >= 2 for v in x + y):
            tests[f"{horizon}: mt_grpo - grpo, exact_match"] = tost(x, y, MARGIN)
    adjusted = holm({k: t["p"] for k, t in tests.items()})
    out["equivalence"] = {k: {**t, "holm": adjusted[k]} for k, t in tests.items()}
    return out


def report(args: argparse.Namespace, design: Design) -> str:
    results = args.results
    choice_path = results / "tuning-choice.json"
    if not choice_path.exists():
        raise SystemExit(f"no tuning-choice.json under {results}: the tuning stage has not "
                         "finished")
    chosen = json.loads(choice_path.read_text())["chosen"]
    seeds, _ = confirmation_warm_starts(results)
    lines = [f"Progress: {progress(results, design)}.", "",
             f"Warm starts (recipe {RECIPE}; held-out evaluation, {EVAL_SAMPLES} samples per "
             f"item at temperature 1: tool-call rate [95 % CI over items], exact match; band "
             f"{list(BAND)} at both horizons):", "",
             "| cell | sha256 | SFT loss first → last | " + " | ".join(
                 f"{h}: tool-call rate | {h}: exact match" for h in HORIZONS)
             + " | in band | used as |", "|---|---|---|" + "---|---:|" * len(HORIZONS)
             + ":-:|---|"]
    for seed in (TUNING_SEED, *range(CANDIDATE_SEED + 1, CANDIDATE_SEED + MAX_CANDIDATES + 1)):
        s = summary_of(results, warm_start_cell(seed))
        if s is None:
            continue
        losses = [r.get("loss") for r in s.get("sft_steps") or [] if r.get("loss") is not None]
        e = s["evaluation"]
        used = ("tuning" if seed == TUNING_SEED else
                f"ws{seeds.index(seed) + 1}" if seed in seeds else "not used")
        lines.append(f"| {warm_start_cell(seed).id} | {s['sha256'][:12]} | " + (
            f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "—") + " | " + " | ".join(
            f"{e[h]['tool_call_rate']:.3f} [{e[h]['tool_call_rate_ci95'][0]:.3f}, "
            f"{e[h]['tool_call_rate_ci95'][1]:.3f}] | {e[h]['exact_match']:.3f}"
            for h in HORIZONS) + f" | {'yes' if s['in_band'] else 'no'} | {used} |")
    for horizon in design.horizons:
        lines += ["", f"Tuning, {horizon} (tuning warm start, seed {TUNING_RUN_SEED}): final "
                  "held-out mean outcome; the rule's choice in bold.", "",
                  "| arm | " + " | ".join(f"lr {lr:g}" for lr in design.lrs) + " |",
                  "|---|" + "---:|" * len(design.lrs)]
        for arm in design.arms:
            row = []
            for lr in design.lrs:
                s = summary_of(results, Cell("tuning", horizon, 0, arm, TUNING_RUN_SEED, lr))
                text = f"{mean_outcome(s):.3f}" if s else "no run"
                row.append(f"**{text}**" if s and chosen[horizon][arm] == lr else text)
            lines.append(f"| {ARMS[arm]} | " + " | ".join(row) + " |")
    rows = run_rows(results, design, chosen)
    for horizon in design.horizons:
        values = rows.get(horizon, {})
        lines += ["", f"**{horizon}**: final held-out rates, mean [95 % t-interval] over "
                  "runs; per warm start, mean exact match.", "",
                  "| arm | lr | runs | exact match | tool success | tool-call rate | " +
                  " | ".join(f"ws{k}" for k in range(1, WARM_STARTS + 1)) + " |",
                  "|---|---:|---:|---:|---:|---:|" + "---:|" * WARM_STARTS]
        for arm in design.arms:
            runs = [r for ws in sorted(values.get(arm, {})) for r in values[arm][ws]]
            if not runs:
                continue
            cells = ["{:.3f} [{:.3f}, {:.3f}]".format(*t_interval([r[m] for r in runs]))
                     for m in FINAL]
            per_ws = [f"{statistics.mean(r['exact_match'] for r in values[arm][k]):.3f}"
                      if k in values[arm] else "—" for k in range(1, WARM_STARTS + 1)]
            lines.append(f"| {ARMS[arm]} | {chosen[horizon][arm]:g} | {len(runs)} | "
                         + " | ".join(cells + per_ws) + " |")
    for family, members in registered_tests(rows).items():
        if not members:
            continue
        lines += ["", f"Tests, {family} (" + (
            f"TOST, 90 % interval; Holm over the horizons; equivalent if Holm p <= {ALPHA}, "
            f"margin ±{MARGIN})" if family == "equivalence" else
            f"{'one' if 'one-sided' in family else 'two'}-sided; Holm within the family; "
            f"significant if Holm p <= {ALPHA})") + ":", "",
            "| comparison | difference | p | p (Holm) |", "|---|---:|---:|---:|"]
        for name, t in members.items():
            extra = f" [{t['low']:+.3f}, {t['high']:+.3f}]" if "low" in t else ""
            lines.append(f"| {name} | {t['difference']:+.3f}{extra} | {cf.p_text(t['p'])} "
                         f"| {cf.p_text(t['holm'])} |")
    lines += ["", "Every run: final held-out exact match / tool success / tool-call rate "
              "(tuning: mean outcome).", "", "| cell | values |", "|---|---|"]
    manifest = cf.read_manifest(results)
    for cell in tuning_cells(design) + confirmation_cells(design, chosen):
        s = summary_of(results, cell)
        if s is not None:
            lines.append(f"| {cell.id} | " + " / ".join(
                f"{final_rate(s, m):.3f}" for m in FINAL) + (
                f" (mean outcome {mean_outcome(s):.3f})" if cell.stage == "tuning" else "")
                + " |")
        elif st.failures(manifest, cell) >= MAX_ATTEMPTS:
            lines.append(f"| {cell.id} | missing ({MAX_ATTEMPTS} failed attempts) |")
    png = args.out.with_suffix(".png")
    plot(results, design, chosen, png)
    lines += ["", f"![confirmation runs: batch exact match per step]({png.name})", ""]
    return "\n".join(lines)


def plot(results: Path, design: Design, chosen: dict[str, dict[str, float]], out: Path
         ) -> None:
    """Per horizon and arm, the confirmation runs' batch exact match per trainer step:
    the mean and its 95 % band."""
    panels = []
    for horizon in design.horizons:
        curves = {}
        for arm in design.arms:
            dirs = [results / c.id for c in confirmation_cells(design, chosen)
                    if c.horizon == horizon and c.arm == arm and summary_of(results, c)]
            curves[f"{ARMS[arm]} ({len(dirs)})"] = dirs
        panels.append((horizon.replace("_", " "), "env/exact_match",
                       "batch exact match (mean, 95 % band)", curves))
    cf.plot_panels(panels, out)


# --- the command line ------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "wiki-search-credit",
                        help="where runs work (weights, checkpoints, logs; not kept)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where finished cells and the manifest are kept (tracked)")
    parser.add_argument("--lock", type=Path, default=None,
                        help="a file locked (flock) around each cell")
    parser.add_argument("--one", action="store_true", help="the next cell only (3: done)")
    parser.add_argument("--status", action="store_true", help="counts per stage, no outcome")
    parser.add_argument("--report", action="store_true", help="the registered analysis")
    parser.add_argument("--out", type=Path, default=None, help="default: RUNS_DIR.md")
    parser.add_argument("--pilot-runs-dir", type=Path, default=PILOT_RUNS,
                        help="the pilot's --runs-dir: the tuning warm start (sft64) is "
                        "copied from there when its hash is the pilot's, else rebuilt")
    smoke = parser.add_argument_group("pilot and smoke runs (need --results elsewhere)")
    smoke.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    smoke.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    smoke.add_argument("--horizons", nargs="+", default=list(HORIZONS), choices=HORIZONS)
    smoke.add_argument("--steps", type=int, default=STEPS, help="RL steps per run")
    smoke.add_argument("--runs", type=int, default=RUNS,
                       help="confirmation runs per arm, warm start and horizon")
    smoke.add_argument("--tuning-only", action="store_true",
                       help="stop once the tuning stage is done (a pilot)")
    args = parser.parse_args()
    args.out = args.out or args.runs_dir.with_suffix(".md")
    design = Design(tuple(args.lrs), tuple(args.horizons), tuple(args.arms), args.steps,
                    args.runs)
    if not design.registered and args.results.resolve() == RESULTS.resolve():
        parser.error("a design other than the registered one must keep its results "
                     "elsewhere: add --results DIR")
    if args.status:
        print(progress(args.results, design))
        return 0
    if args.report:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report(args, design))
        print(args.out.read_text())
        return 0
    check_design(args, design)

    def tuning_done(cell: Cell) -> bool:
        done = (args.tuning_only and cell.stage != "tuning"
                and cell.id != warm_start_cell(TUNING_SEED).id)
        if done:
            print("tuning stage done (--tuning-only)")
        return done

    return st.run_cells(args, design, "experiments/wiki_search_credit.py", next_cell,
                        progress, run_one, stop=tuning_done)


if __name__ == "__main__":
    sys.exit(main())
