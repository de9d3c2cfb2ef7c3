"""The end of a run: a before/after table of the evaluations and the reward curve."""

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


def _num(value: Any, ci: list[float] | None = None) -> str:
    """``0.234 [0.183, 0.292]``: the figure and its 95 % confidence interval."""
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def reward_curve(metrics_path: Path, out: Path, title: str) -> Path | None:
    """PNG of the batch mean reward (and env accuracy/tool success when logged) per step."""
    rows = []
    with open(metrics_path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
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
    png = reward_curve(metrics_path, run_dir / "reward_curve.png",
                       f"{run_dir.name}: rollout batches during RL")
    if png is not None:
        written["reward_curve"] = str(png)
        parts.append(f"![reward curve]({png.name})")
    (run_dir / "summary.md").write_text("\n".join(parts) + "\n")
    return written
