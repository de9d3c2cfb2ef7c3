"""The end of a run: a before/after table of the evaluations, sample transcripts of the
same held-out items before and after, where the time went, and the reward curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.metrics import stopped_early_text

# (metric in the evaluation result, label); env-specific metrics come after these.
_ROWS = [("tool_success", "tool-call success"), ("correct", "answer accuracy"),
         ("mean_outcome", "mean reward (outcome)"), ("tool_errors_per_episode", "tool errors / episode"),
         ("truncated_rate", "truncated")]


def before_after_table(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Markdown: one row per metric, one before/after/change triple per env."""
    lines = []
    for env in before:
        b, a = before[env], after.get(env, {})
        lines += [f"**{env}** ({b.get('items')} eval items, {b.get('failed', 0)} + "
                  f"{a.get('failed', 0)} failed)", "",
                  "| metric (95 % CI) | before RL | after RL | change |",
                  "|---|---:|---:|---:|"]
        for key, label in _ROWS:
            if b.get(key) is None and a.get(key) is None:
                continue
            x, y = b.get(key), a.get(key)
            change = f"{y - x:+.3f}" if x is not None and y is not None else "-"
            lines.append(f"| {label} | {_num(x, b.get(key + '_ci95'))} | "
                         f"{_num(y, a.get(key + '_ci95'))} | {change} |")
        lines.append("")
    return "\n".join(lines)


def _episode(group: dict[str, Any]) -> tuple[str, str, Any]:
    """The first episode of an evaluation group: (the user's question, the turns after
    it as text, its scores)."""
    trajectory = group["trajectories"][0]
    messages = trajectory.get("messages") or []
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    question = messages[users[0]]["content"] if users else ""
    turns = []
    for message in messages[users[0] + 1 if users else 0:]:
        content = str(message.get("content") or "").strip()
        calls = [f'<tool_call>{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})}</tool_call>'
                 for c in message.get("tool_calls") or [] if "function" in c]
        if calls and "<tool_call>" not in content:
            content = " ".join([content, *calls]).strip()
        turns.append(f"{message.get('role')}: {content}")
    return question, "\n".join(turns), trajectory.get("scores")


def transcripts(before: Path, after: Path, n: int = 3) -> str:
    """Markdown: the first episode of ``n`` held-out items evaluated both before and after
    RL (the same items, sampled at the evaluation's temperature): the first items, in
    evaluation order, whose first episode's outcome changed (better or worse), then, if
    fewer did, the first of the others."""
    def groups(path: Path) -> dict[str, dict[str, Any]]:
        found = {}
        with open(path) as f:
            for line in f:
                group = json.loads(line)
                found.setdefault(group.get("item_id"), group)
        return found

    def outcome(group: dict[str, Any]) -> Any:
        scores = group["trajectories"][0].get("scores")
        return scores[-1] if isinstance(scores, list) else scores

    b, a = groups(before), groups(after)
    both = [item for item in b if item in a]
    changed = [item for item in both if outcome(b[item]) != outcome(a[item])]
    shown = (changed + [item for item in both if item not in changed])[:n]
    if not shown:
        return ""
    lines = [f"Sample transcripts: the first episode of {len(shown)} held-out items before "
             f"and after RL, the first {min(len(changed), n)} of them among the "
             f"{len(changed)} of {len(both)} whose outcome changed (turn scores in "
             "brackets).", ""]
    for item in shown:
        question, _, _ = _episode(b[item])
        lines += [f"**{question}**", "", "```text"]
        for label, group in (("before", b[item]), ("after", a[item])):
            _, text, scores = _episode(group)
            lines += [f"--- {label} RL {scores}", text]
        lines += ["```", ""]
    return "\n".join(lines)


def _num(value: Any, ci: list[float] | None = None) -> str:
    """``0.234 [0.183, 0.292]``: the figure and its 95 % confidence interval."""
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def reward_curve(metrics_path: Path, out: Path, title: str) -> Path | None:
    """PNG of the batch mean reward (and env accuracy/tool success when logged) per step."""
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps = [r["step"] for r in rows]
    for key, label in [("reward_mean", "mean reward"), ("env/correct", "answer accuracy"),
                       ("env/tool_success", "tool-call success")]:
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key) for r in rows], label=label, marker=".")
    ax.set_xlabel("trainer step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


_STEP_PARTS = [("batch_wait", "waiting for batches"), ("prepare", "advantages, packing"),
               ("train", "forward, backward, optimizer"), ("sync", "weight syncs"),
               ("checkpoint", "checkpoints"),
               ("hang_wait", "waiting on a process that did not answer")]
_ROLLOUT_PARTS = [("generation", "generation"), ("env", "env (tools, rewards)"),
                  ("queue_wait", "queue wait")]


def read_metrics(metrics_path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        with open(metrics_path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return rows


def time_table(phases: dict[str, float], rows: list[dict[str, Any]],
               training: dict[str, float] | None = None) -> str:
    """Markdown: "where the time went". ``phases``: seconds of each phase of the run, in
    order (the RL phase is ``training``), which add up to the run's wall time; ``rows``:
    the trainer's metrics, whose ``time/*`` (trainer/timing.py) split the training phase,
    and whose ``env/time/*`` (per rollout, means per batch) say what a rollout spent on
    what. ``training``: ``{"started_at", "ended_at"}`` (wall clock) of this start's
    training phase, so that steps logged by an earlier start of a resumed run are left
    out, and ``trainer_hung_s``, the seconds the supervisor found the trainer hung (its
    lost step is not in the metrics). The training phase's rows add up to it: the steps'
    parts (``hang_wait``, the waits on a process that did not answer, among them, with
    the trainer's own hangs), the rest of the steps, and what lay outside the steps
    logged (the trainer's start, its restarts and the steps they lost, the supervisor
    noticing its end)."""
    training = training or {}
    total = sum(phases.values())

    def row(label: str, seconds: float) -> str:
        return (f"| {label} | {seconds:.1f} | {seconds / total:.0%} |" if total else
                f"| {label} | {seconds:.1f} | - |")

    lines = ["**Where the time went**", "", "| where | seconds | share |", "|---|---:|---:|"]
    for name, seconds in phases.items():
        lines.append(row(name, seconds))
        steps = [r for r in rows if "time/step" in r and (
            "logged_at" not in r or "started_at" not in training
            or training["started_at"] <= r["logged_at"] <= training["ended_at"])]
        if name == "training" and steps:
            in_steps = sum(r["time/step"] for r in steps)
            # The trainer starts while vLLM does: what its first step waited for a batch
            # before the training phase began is in the phases before it.
            before = min(max(0.0, in_steps - seconds), steps[0].get("time/batch_wait", 0.0))
            in_steps -= before
            hung = min(training.get("trainer_hung_s", 0.0), max(0.0, seconds - in_steps))
            counted = 0.0
            for part, label in _STEP_PARTS:
                value = sum(r.get(f"time/{part}", 0.0) for r in steps)
                if part == "batch_wait":
                    value -= before
                if part == "hang_wait":
                    value += hung
                counted += value
                lines.append(row(f"&nbsp;&nbsp;{label}", value))
            lines.append(row(f"&nbsp;&nbsp;rest of the {len(steps)} steps",
                             in_steps - (counted - hung)))
            lines.append(row("&nbsp;&nbsp;outside the steps (the trainer's start, restarts "
                             "and the steps they lost)", seconds - in_steps - hung))
    lines.append(f"| **total** | {total:.1f} | |")
    rollout = [(label, [r[f"env/time/{part}"] for r in rows if f"env/time/{part}" in r])
               for part, label in _ROLLOUT_PARTS]
    if any(values for _, values in rollout):
        lines += ["", "A rollout's seconds (mean over the batches): " + ", ".join(
            f"{label} {sum(values) / len(values):.2f}" for label, values in rollout if values)
            + "."]
    return "\n".join(lines) + "\n"


def write_summary(run_dir: Path, summary: dict[str, Any], metrics_path: Path) -> dict[str, Any]:
    written: dict[str, Any] = {}
    parts = [f"# Run {run_dir.name}", ""]
    if summary.get("stopped_early"):
        parts += [f"**{stopped_early_text(summary['stopped_early'])}** "
                  "(`train.max_batch_wait_s`; the trainer's log says why). The \"after\" "
                  "column evaluates the weights of that step.", ""]
    if "before" in summary and "after" in summary:
        written["table"] = before_after_table(summary["before"], summary["after"])
        parts.append(written["table"])
    if any((run_dir / "eval").glob("*.jsonl")):  # every evaluation's episodes, to browse
        from environments.inspection import write_report

        page = write_report(run_dir / "eval", run_dir / "eval" / "report.html",
                            title=f"{run_dir.name}: held-out evaluations before and after RL")
        written["eval_report"] = str(page.path)
        parts.append(f"Every evaluation episode: [eval/report.html](eval/report.html).\n")
    for before in sorted((run_dir / "eval").glob("before-*.jsonl")):
        after = before.with_name("after-" + before.name[len("before-"):])
        if after.exists():
            text = transcripts(before, after)
            if text:
                written.setdefault("transcripts", []).append(text)
                parts.append(text)
    if summary.get("phases"):
        written["time_table"] = time_table(summary["phases"], read_metrics(metrics_path),
                                           summary.get("training"))
        parts.append(written["time_table"])
    png = reward_curve(metrics_path, run_dir / "reward_curve.png",
                       f"{run_dir.name}: rollout batches during RL")
    if png is not None:
        written["reward_curve"] = str(png)
        parts.append(f"![reward curve]({png.name})")
    (run_dir / "summary.md").write_text("\n".join(parts) + "\n")
    return written


def accounting_problems(a: dict[str, Any]) -> list[str]:
    """Where the rollout API's accounting does not add up (empty: it does)."""
    problems = []
    parts = a["trained"] + a["set_aside"] + a["dropped"] + a["queued"] + a["leased"]
    if a["received"] != parts:
        problems.append(f"received {a['received']} != trained + set aside + dropped + queued "
                        f"+ leased = {parts}")
    for total, reasons in (("dropped", "dropped_reasons"), ("set_aside", "set_aside_reasons")):
        if a[total] != sum(a[reasons].values()):
            problems.append(f"{total} {a[total]} != the sum of its reasons {a[reasons]}")
    if a["trained_again_after_resume"] > a["trained"]:
        problems.append("more groups trained again than trained")
    return problems


def accounting_text(a: dict[str, Any]) -> str:
    """The groups of a run, where each went, and whether the numbers add up."""
    def reasons(found: dict[str, int]) -> str:
        return ("  (" + ", ".join(f"{k}: {v}" for k, v in sorted(found.items())) + ")"
                if found else "")

    problems = accounting_problems(a)
    lines = [
        f"groups received        {a['received']:>7}",
        f"  trained              {a['trained']:>7}   of which trained again after a resume "
        f"(their first update died with a trainer): {a['trained_again_after_resume']}",
        f"  set aside            {a['set_aside']:>7}{reasons(a['set_aside_reasons'])}",
        f"  dropped              {a['dropped']:>7}{reasons(a['dropped_reasons'])}",
        f"  still queued         {a['queued']:>7}",
        f"  leased (in a step)   {a['leased']:>7}",
        f"resumes {a.get('resumes', 0)}; groups released from dead trainers' leases "
        f"{a.get('released_from_dead_trainers', 0)}; kept from lost policy versions "
        f"{a.get('kept_lost_policy_groups', 0)}; duplicate pushes ignored "
        f"{a.get('duplicate_pushes_ignored', 0)}",
        "adds up: yes" if not problems else "adds up: NO: " + "; ".join(problems)]
    return "\n".join(lines)
