"""``lachesis inspect``: groups and trajectories in the terminal, rendered with ``rich``."""

from __future__ import annotations

from pathlib import Path

from rich.color import Color
from rich.console import Console, Group
from rich.panel import Panel
from rich.rule import Rule
from rich.style import Style
from rich.table import Table
from rich.text import Text

from environments.inspection.data import (
    ConversationRow,
    Filter,
    GroupSummary,
    Match,
    Stats,
    StatsAccumulator,
    TokenDecoder,
    conversation,
    n_trained,
    n_turns,
    scan,
    summarize,
    token_rows,
)
from environments.jsonl_store import ReadReport
from environments.trajectory import ScoredTrajectory

ROLE_STYLES = {"system": "magenta", "user": "green", "assistant": "bold cyan", "tool": "yellow",
               "sampled": "bold cyan", "context": "dim"}


def _score(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def _signed(value: float) -> str:
    return f"{value:+.3g}"


def _flags(t: ScoredTrajectory) -> list[str]:
    flags = []
    if t.flags.truncated:
        flags.append("truncated")
    if t.flags.tool_errors:
        flags.append(f"{t.flags.tool_errors} tool error{'s' * (t.flags.tool_errors > 1)}")
    if not t.flags.trainable:
        flags.append("not trainable")
    return flags


def group_header(s: GroupSummary) -> Rule:
    parts = [f"group #{s.index}", s.location]
    if s.env:
        parts.append(s.env)
    if s.item_id is not None:
        parts.append(f"item {s.item_id}")
    parts.append(f"{len(s.outcomes)} trajector{'y' if len(s.outcomes) == 1 else 'ies'}")
    if s.policy_version is not None:
        parts.append(f"policy v{s.policy_version}")
    return Rule(Text(" · ".join(parts), style="bold"), align="left")


def group_overview(s: GroupSummary) -> Text:
    outcomes = " ".join(_score(o) for o in s.outcomes)
    return Text(f"outcomes {outcomes} · mean {s.mean:.3g} · spread (std) {s.spread:.3g}"
                f" · id {s.group_id}", style="dim")


def trajectory_title(i: int, t: ScoredTrajectory) -> Text:
    title = Text(f"trajectory {i} · outcome {_score(t.outcome)}", style="bold")
    for flag in _flags(t):
        title.append(" · ")
        title.append(flag, style="bold red")
    return title


def trajectory_facts(t: ScoredTrajectory) -> Text:
    trained = n_trained(t)
    parts = [f"{n_turns(t)} turn{'s' * (n_turns(t) != 1)}",
             f"{len(t.tokens)} tokens: {trained} trained, {len(t.tokens) - trained} context"]
    if t.policy_version is not None:
        parts.append(f"policy v{t.policy_version}")
    if t.metadata.get("stop"):
        parts.append(f"stop: {t.metadata['stop']}")
    return Text(" · ".join(parts), style="dim")


def _clip(text: str, max_chars: int) -> str:
    if max_chars and len(text) > max_chars:
        return f"{text[:max_chars]}… ({len(text) - max_chars} more chars)"
    return text


def _role_cell(row: ConversationRow) -> Text:
    cell = Text(row.role, style=ROLE_STYLES.get(row.role, ""))
    turn = row.turn
    if turn is None:
        return cell
    cell.append(f"\nturn {turn.index}{' (outcome)' if turn.is_last else ''}", style="cyan")
    if turn.new_segment:
        cell.append(f"\nnew segment {turn.segment}", style="magenta")
    cell.append(f"\nscore {_score(turn.score)}", style="bold")
    if turn.advantage is not None:
        cell.append(f"\nadv {_signed(turn.advantage)}",
                    style="green" if turn.advantage >= 0 else "red")
    cell.append(f"\n{turn.n_trained}/{turn.n_tokens} tok", style="dim")
    if turn.policy_version is not None:
        cell.append(f" v{turn.policy_version}", style="dim")
    return cell


def conversation_table(t: ScoredTrajectory, decoder: TokenDecoder, max_chars: int) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True, min_width=10)
    table.add_column(overflow="fold")
    for row in conversation(t, decoder):
        table.add_row(_role_cell(row), Text(_clip(row.content, max_chars)))
    return table


def _advantage_style(advantage: float | None, scale: float) -> Style:
    if advantage is None:
        return Style(color="cyan", underline=True)
    level = min(abs(advantage) / scale, 1.0) if scale else 0.0
    shade = int(40 + 140 * level)
    rgb = (0, shade, 0) if advantage >= 0 else (shade, 0, 0)
    return Style(color="white", bgcolor=Color.from_rgb(*rgb))


def token_text(t: ScoredTrajectory, decoder: TokenDecoder) -> Text:
    """Context tokens dim; trained tokens coloured by advantage (green +, red -), or
    underlined when there are no advantages."""
    rows = token_rows(t, decoder)
    scale = max((abs(r.advantage) for r in rows if r.advantage is not None), default=0.0)
    text = Text()
    for r in rows:
        style = _advantage_style(r.advantage, scale) if r.trained else Style(dim=True)
        text.append(r.text, style=style)
    return text


def trajectory_panel(i: int, t: ScoredTrajectory, decoder: TokenDecoder, *,
                     max_chars: int, tokens: bool) -> Panel:
    body = [trajectory_facts(t), conversation_table(t, decoder, max_chars)]
    if tokens:
        body += [Rule("tokens: context dim, trained underlined or coloured by advantage",
                      style="dim"), token_text(t, decoder)]
    return Panel(Group(*body), title=trajectory_title(i, t), title_align="left",
                 border_style="red" if _flags(t) else "blue")


def render_group(console: Console, match: Match, decoder: TokenDecoder, *,
                 max_chars: int = 600, tokens: bool = False) -> None:
    summary = summarize(match)
    console.print(group_header(summary))
    console.print(group_overview(summary))
    for i, t in enumerate(match.group.trajectories):
        if i in match.matching:
            console.print(trajectory_panel(i, t, decoder, max_chars=max_chars, tokens=tokens))
        else:
            console.print(Text(f"  trajectory {i} · outcome {_score(t.outcome)} "
                               "(hidden by the filter)", style="dim"))


def _bar(n: int, most: int, width: int = 30) -> str:
    return "█" * max(1, round(width * n / most)) if n else ""


def stats_tables(stats: Stats, path: Path, report: ReadReport, filter: Filter) -> list:
    overview = Table(title=f"{path}", title_justify="left", show_header=False, box=None)
    overview.add_column(style="bold")
    overview.add_column()
    overview.add_row("groups", f"{stats.groups} (filter: {filter.describe()})")
    overview.add_row("trajectories", str(stats.trajectories))
    overview.add_row("bad lines skipped", str(len(report.bad_lines)))
    overview.add_row("envs", ", ".join(f"{e} ({n})" for e, n in stats.envs.items()))
    if not stats.trajectories:
        return [overview]
    overview.add_row("outcome", f"mean {stats.outcome_mean:.4g} · std {stats.outcome_std:.4g}"
                     f" · min {stats.outcome_min:.4g} · max {stats.outcome_max:.4g}")
    overview.add_row("equal-score groups",
                     f"{stats.equal_score_groups} of {stats.groups} (every trajectory scored "
                     "the same, turn by turn: no signal; env process counts these as "
                     "groups_kept_equal_scores)")
    overview.add_row("truncated", f"{stats.truncated} ({stats.truncated_rate:.1%})")
    overview.add_row("tool errors", f"{stats.with_tool_errors} of {stats.trajectories} trajectories "
                     f"({stats.tool_error_rate:.1%}) · {stats.tool_errors} in all")
    overview.add_row("not trainable", str(stats.not_trainable))
    overview.add_row("tokens", f"{stats.tokens / stats.trajectories:.1f} per trajectory · "
                     f"{stats.trained_tokens / stats.tokens:.1%} trained")
    overview.add_row("policy versions", ", ".join(f"{v} ({n})"
                                                  for v, n in stats.policy_versions.items()))

    def distribution(title: str, label: str, items: list[tuple[str, int]]) -> Table:
        table = Table(title=title, title_justify="left")
        table.add_column(label)
        table.add_column("trajectories", justify="right")
        table.add_column("")
        most = max(n for _, n in items)
        for key, n in items:
            table.add_row(key, str(n), Text(_bar(n, most), style="cyan"))
        return table

    tables = [overview, distribution("Outcome distribution", "outcome",
                                     stats.outcome_histogram),
              distribution("Assistant turns per trajectory", "turns",
                           [(str(k), n) for k, n in stats.turns.items()])]
    if stats.turn_score_means:
        per_turn = Table(title="Per-turn score means",
                         title_justify="left")
        per_turn.add_column("turn")
        per_turn.add_column("mean score", justify="right")
        per_turn.add_column("trajectories", justify="right")
        for k, mean, n in stats.turn_score_means:
            per_turn.add_row(str(k), f"{mean:.4g}", str(n))
        tables.append(per_turn)
    return tables


MAX_BAD_LINES_SHOWN = 20
"""A file of thousands of bad lines lists the first ones and counts the rest."""


def report_bad_lines(console: Console, path: Path, report: ReadReport) -> None:
    for bad in report.bad_lines[:MAX_BAD_LINES_SHOWN]:
        console.print(f"{bad.path or path}:{bad.line_no}: {bad.message} (skipped)",
                      markup=False, highlight=False, soft_wrap=True)
    if len(report.bad_lines) > MAX_BAD_LINES_SHOWN:
        console.print(f"... and {len(report.bad_lines) - MAX_BAD_LINES_SHOWN} more bad lines "
                      "(the HTML report lists more)", highlight=False, soft_wrap=True)
    if report.bad_lines:
        console.print(f"{len(report.bad_lines)} bad line{'s' * (len(report.bad_lines) > 1)} "
                      f"skipped in {path}", style="bold red", highlight=False,
                      soft_wrap=True)


def inspect_file(path: Path, *, filter: Filter, console: Console, err_console: Console,
                 decoder: TokenDecoder, group: str | None = None, limit: int = 10,
                 stats: bool = False, tokens: bool = False, max_chars: int = 600) -> int:
    """The body of ``lachesis inspect``; returns the exit status."""
    report = ReadReport()
    status = 0
    if stats:
        accumulator = StatsAccumulator()
        for match in scan(path, filter, report):
            accumulator.add(match.group, match.matching)
        for table in stats_tables(accumulator.result(), path, report, filter):
            console.print(table)
            console.print()
    elif group is not None:
        found = None
        for match in scan(path, Filter(), report):
            if str(match.index) == group or match.group.group_id == group:
                found = match
                break
        if found is None:
            err_console.print(f"{path}: no group {group!r} (by index from 0 or by group id); "
                              f"it has {report.groups} groups", highlight=False,
                              soft_wrap=True)
            status = 1
        else:
            render_group(console, found, decoder, max_chars=max_chars, tokens=tokens)
    else:
        shown = 0
        for match in scan(path, filter, report):
            render_group(console, match, decoder, max_chars=max_chars, tokens=tokens)
            console.print()
            shown += 1
            if limit and shown >= limit:
                console.print(f"showed the first {shown} matching groups (--limit {limit}; "
                              "--limit 0 shows all)", style="dim", highlight=False,
                              soft_wrap=True)
                break
        else:
            console.print(f"{shown} matching groups of {report.groups} in {path} "
                          f"(filter: {filter.describe()})", style="dim", highlight=False,
                          soft_wrap=True)
    report_bad_lines(err_console, path, report)
    if report.groups == 0 and report.bad_lines:
        status = 1
    return status


def show_dead_letters(console: Console, data: dict, *, max_chars: int = 600) -> None:
    """The rollout API's dead letters (``GET /dead_letters``): the groups the trainer set
    aside, newest first, with what was wrong with each."""
    import datetime

    letters = data["dead_letters"]
    shown = f" (newest {len(letters)} shown)" if len(letters) < data["total"] else ""
    console.print(f"dead letters: {data['total']} groups set aside by the trainer{shown}",
                  style="bold", highlight=False)
    for letter in letters:
        group = letter["group"]
        when = datetime.datetime.fromtimestamp(letter["at"], datetime.timezone.utc)
        env = group.get("env") or (f"env_id {letter['env_id']}"
                                   if letter["env_id"] is not None else "-")
        reason = letter["reason"]
        if max_chars and len(reason) > max_chars:
            reason = reason[:max_chars] + "…"
        console.print(f"{when:%Y-%m-%d %H:%M:%S} UTC  group {letter['group_id']}  env {env}  "
                      f"item {group.get('item_id') or '-'}  "
                      f"{len(group.get('tokens') or [])} sequences  "
                      f"trainer {letter['trainer'] or '-'}", highlight=False, soft_wrap=True)
        console.print(Text("    " + reason, style="red"), soft_wrap=True)
