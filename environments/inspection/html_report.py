"""``lachesis report``: one self-contained HTML file (inline CSS and JS, works offline).

The file is written in two streaming passes over the JSONL, so memory stays bounded
whatever the file's size:

1. every line is parsed (bad lines are recorded with their numbers and skipped); the
   statistics accumulate over all matching groups, and only each matching group's byte
   offset and size are kept;
2. the groups to embed are chosen (all of them if they fit in ``max_groups`` and
   ``max_bytes`` of JSONL, else the first ones or a uniform random sample that fits),
   re-read by offset one at a time and written out as one JSON chunk each.

The page renders the group list from a compact summary; a group's detail (members side
by side, per-turn scores, the token view) is built from its chunk (compressed JSON) when
it is opened.
The page says what was included.
"""

from __future__ import annotations

import base64
import html
import os
import shutil
import tempfile
import time
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from environments.inspection.data import (
    Filter,
    Match,
    Selection,
    Stats,
    StatsAccumulator,
    TokenDecoder,
    conversation,
    jsonl_files,
    mask_runs,
    scan,
    select,
    summarize,
)
from environments.jsonl_store import BadLine, LocatedGroup, ReadReport, read_group_at
from environments.trajectory import MASKED, ScoredTrajectory

ASSETS = Path(__file__).parent
MAX_BAD_LINES_LISTED = 200


@dataclass
class ReportResult:
    path: Path
    groups: int
    """Matching groups in the file."""
    embedded: int
    """Groups embedded in the page (all of them, or a sample)."""
    selection: str
    bad_lines: int
    bytes: int
    seconds: float
    stats: Stats = field(repr=False, default_factory=Stats)
    bad_lines_list: list[BadLine] = field(repr=False, default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"report": str(self.path), "groups": self.groups, "embedded": self.embedded,
                "selection": self.selection, "bad_lines": self.bad_lines,
                "report_bytes": self.bytes, "seconds": round(self.seconds, 2)}


def _json(value: Any) -> bytes:
    """JSON that is safe inside a <script> element."""
    return orjson.dumps(value).replace(b"<", b"\\u003c")


def _packed(value: Any) -> bytes:
    """JSON, zlib-compressed, base64: a group's detail chunk (the page inflates it with
    the browser's DecompressionStream when the group is opened). Token ids and logprobs
    compress ~4x, so pages are smaller and load faster."""
    return base64.b64encode(zlib.compress(orjson.dumps(value), 6))




def _round(values: list[float] | None, masks: list[int] | None = None,
           digits: int = 3) -> list[float | None] | None:
    if values is None:
        return None
    if masks is None:
        return [round(v, digits) for v in values]
    return [round(v, digits) if m != MASKED else None for v, m in zip(values, masks)]


def trajectory_detail(t: ScoredTrajectory, matched: bool, vocab_ids: set[int],
                      decoder: TokenDecoder | None = None) -> dict:
    rows = conversation(t, decoder)
    turns = [row.turn for row in rows if row.turn is not None]
    vocab_ids.update(t.tokens)
    return {
        "o": t.outcome,
        "per_turn": t.turn_scores is not None,
        "pv": t.policy_version,
        "fl": t.flags.model_dump(),
        "stop": t.metadata.get("stop"),
        "match": matched,
        "turns": [{"s": r.score, "a": None if r.advantage is None else round(r.advantage, 4),
                   "v": r.policy_version, "n": r.n_tokens, "k": r.n_trained,
                   "sp": [r.start, r.end], "ns": r.new_segment} for r in turns],
        "msgs": [[row.role, row.content, None if row.turn is None else row.turn.index]
                 for row in rows],
        "tok": t.tokens,
        "tr": [[start, end] for start, end, trained in mask_runs(t.masks) if trained],
        "lp": _round(t.inference_logprobs, t.masks),
        "adv": _round(t.advantages, digits=4),
        "seg": t.segment_starts or [],
    }


def group_detail(match: Match, vocab_ids: set[int], decoder: TokenDecoder | None = None
                 ) -> dict:
    group = match.group
    s = summarize(match)
    line = match.line_no if not match.from_directory else match.location
    return {"i": match.index, "line": line, "id": group.group_id, "env": group.env,
            "item": s.item_id, "pv": s.policy_version,
            "gen": group.generation_params, "meta": group.metadata or None,
            "t": [trajectory_detail(t, i in match.matching, vocab_ids, decoder)
                  for i, t in enumerate(group.trajectories)]}


def summary_row(match: Match) -> list:
    s = summarize(match)
    line = s.line_no if not match.from_directory else s.location
    return [s.index, line, s.env or "", s.item_id or "", s.outcomes,
            round(s.mean, 4), round(s.spread, 4), s.truncated, s.tool_errors,
            s.policy_version, round(s.mean_turns, 2), s.tokens, s.trained_tokens,
            len(s.matching)]


# -- static parts of the page ----------------------------------------------------------------
def _e(value: Any) -> str:
    return html.escape(str(value))


def _bars(items: list[tuple[str, int]], label: str) -> str:
    most = max((n for _, n in items), default=1) or 1
    rows = "".join(
        f'<tr><td>{_e(k)}</td><td class="num">{n}</td><td class="barcell">'
        f'<div class="bar" style="width:{100 * n / most:.1f}%"></div></td></tr>'
        for k, n in items)
    return (f'<table class="dist"><thead><tr><th>{_e(label)}</th><th>trajectories</th>'
            f'<th></th></tr></thead><tbody>{rows}</tbody></table>')


def stats_html(stats: Stats) -> str:
    if not stats.trajectories:
        return "<p>No matching trajectories.</p>"
    overview = [
        ("groups", f"{stats.groups:,} ({stats.equal_score_groups:,} with equal scores: every "
                   "trajectory scored the same, turn by turn, so no signal; env process "
                   "counts these as groups_kept_equal_scores)"),
        ("trajectories", f"{stats.trajectories:,}"),
        ("envs", ", ".join(f"{e} ({n:,})" for e, n in stats.envs.items())),
        ("outcome", f"mean {stats.outcome_mean:.4g} · std {stats.outcome_std:.4g} · "
                    f"min {stats.outcome_min:.4g} · max {stats.outcome_max:.4g}"),
        ("truncated", f"{stats.truncated:,} ({stats.truncated_rate:.1%})"),
        ("tool errors", f"{stats.with_tool_errors:,} of {stats.trajectories:,} trajectories "
                        f"({stats.tool_error_rate:.1%}) · {stats.tool_errors:,} in all"),
        ("not trainable", f"{stats.not_trainable:,}"),
        ("tokens", f"{stats.tokens / stats.trajectories:,.1f} per trajectory · "
                   f"{stats.trained_tokens / stats.tokens:.1%} trained"),
        ("policy versions", ", ".join(f"{v} ({n:,})" for v, n in stats.policy_versions.items())),
    ]
    parts = ['<table class="kv">' + "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in overview) + "</table>",
        '<div class="dists">',
        "<div><h3>Outcome distribution</h3>" + _bars(stats.outcome_histogram, "outcome")
        + "</div>",
        "<div><h3>Assistant turns per trajectory</h3>"
        + _bars([(str(k), n) for k, n in stats.turns.items()], "turns") + "</div>"]
    if stats.turn_score_means:
        rows = "".join(f'<tr><td>{k}</td><td class="num">{m:.4g}</td><td class="num">{n:,}'
                       "</td></tr>" for k, m, n in stats.turn_score_means)
        parts.append("<div><h3>Per-turn score means</h3><table class=\"dist\"><thead><tr>"
                     "<th>turn</th><th>mean score</th><th>trajectories</th></tr></thead>"
                     f"<tbody>{rows}</tbody></table></div>")
    parts.append("</div>")
    return "".join(parts)


def selection_html(selection: Selection, max_groups: int, max_bytes: int, seed: int,
                   stats: Stats) -> str:
    n, total = len(selection.indices), selection.total
    if selection.method == "all":
        text = f"All {total:,} matching groups are included."
    else:
        how = ("the first ones in the file" if selection.method == "first"
               else f"a uniform random sample (seed {seed})")
        limits = " and ".join({"max_groups": f"{max_groups:,} groups",
                               "max_bytes": f"{max_bytes / 1e6:g} MB of JSONL"}[x]
                              for x in selection.limited_by)
        text = (f"Included: {n:,} of {total:,} matching groups, {how}, to stay within "
                f"{limits}. The statistics cover all {total:,} matching groups "
                f"({stats.trajectories:,} trajectories).")
    return f'<p class="note" id="included">{_e(text)}</p>'


def bad_lines_html(source: Path, report: ReadReport) -> str:
    if not report.bad_lines:
        return ""
    items = "".join(f"<li><code>{_e((b.path or source).name)}:{b.line_no}</code>: "
                    f"{_e(b.message)}</li>"
                    for b in report.bad_lines[:MAX_BAD_LINES_LISTED])
    more = len(report.bad_lines) - MAX_BAD_LINES_LISTED
    if more > 0:
        items += f"<li>… and {more:,} more</li>"
    return (f'<section id="bad-lines"><h2>{len(report.bad_lines):,} bad line'
            f'{"s" * (len(report.bad_lines) > 1)} skipped</h2><ul>{items}</ul></section>')


# -- the writer ------------------------------------------------------------------------------
def write_report(source: str | Path, out: str | Path | None = None, *,
                 filter: Filter | None = None, decoder: TokenDecoder | None = None,
                 max_groups: int = 1000, max_mb: float = 100.0, sample: str = "random",
                 seed: int = 0, title: str | None = None) -> ReportResult:
    """Write the HTML report of the JSONL file ``source`` to ``out`` (default: next to it,
    ``.html``). ``source`` may be a directory: its ``*.jsonl`` files in name order (see
    :func:`~environments.inspection.data.jsonl_files`; default ``out``: ``report.html`` in
    it). Bad lines are listed on the page and skipped."""
    started = time.monotonic()
    source = Path(source)
    files = jsonl_files(source)  # SourceError (naming the path) when there is nothing
    if out is None:
        out = source / "report.html" if source.is_dir() else source.with_suffix(".html")
    out = Path(out)
    filter = filter or Filter()
    decoder = decoder or TokenDecoder()
    max_bytes = int(max_mb * 1e6)

    # Pass 1: statistics over everything; keep only where each matching group is.
    report = ReadReport()
    accumulator = StatsAccumulator()
    offsets, sizes, indices, line_nos = array("q"), array("q"), array("q"), array("q")
    file_of, file_index = array("q"), {}  # which file each group is in, by number
    for match in scan(source, filter, report):
        file_of.append(file_index.setdefault(match.located.path, len(file_index)))
        accumulator.add(match.group, match.matching)
        offsets.append(match.located.offset)
        sizes.append(match.located.size)
        indices.append(match.index)
        line_nos.append(match.line_no)
    stats = accumulator.result()
    selection = select(sizes, max_groups=max_groups, max_bytes=max_bytes, method=sample,
                       seed=seed)

    # Pass 2: the embedded groups, re-read by offset one at a time.
    summaries: list[list] = []
    vocab_ids: set[int] = set()
    paths = list(file_index)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out.parent) as chunks:
        for k in selection.indices:
            path = paths[file_of[k]]
            group = read_group_at(path, offsets[k], sizes[k])
            located = LocatedGroup(line_nos[k], offsets[k], sizes[k], group, path)
            match = Match(indices[k], located, filter.matching(group), source.is_dir())
            summaries.append(summary_row(match))
            chunks.write(b'<script type="application/octet-stream" class="g" id="g' +
                         str(match.index).encode() + b'">' +
                         _packed(group_detail(match, vocab_ids, decoder)) + b"</script>\n")
        chunks.seek(0)
        tmp = out.with_name(out.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(_page_head(source, files, title, filter, decoder, stats, selection,
                               report, max_groups, max_bytes, seed).encode())
            f.write(b'<script type="application/json" id="summary">' + _json(summaries)
                    + b"</script>\n<script>" + (ASSETS / "report.js").read_bytes()
                    + b"</script>\n")
            shutil.copyfileobj(chunks, f, 1 << 20)
            vocab = ({i: decoder.text(i) for i in sorted(vocab_ids)} if decoder.has_text
                     else {})
            f.write(b'<script type="application/json" id="vocab">' +
                    _json({str(k): v for k, v in vocab.items()}) + b"</script>\n"
                    b"</body></html>\n")
        os.replace(tmp, out)
    return ReportResult(out, selection.total, len(selection.indices), selection.method,
                        len(report.bad_lines), out.stat().st_size,
                        time.monotonic() - started, stats, report.bad_lines)


def _page_head(source: Path, files: list[Path], title: str | None, filter: Filter,
               decoder: TokenDecoder, stats: Stats, selection: Selection, report: ReadReport,
               max_groups: int, max_bytes: int, seed: int) -> str:
    title = title or f"Lachesis report: {source.name}"
    size = sum(path.stat().st_size for path in files)
    tokens = "decoded with the tokenizer" if decoder.has_text else "ids (no --tokenizer)"
    where = _e(source)
    if source.is_dir():
        names = ", ".join(path.name for path in files[:5])
        more = f", … ({len(files) - 5} more)" if len(files) > 5 else ""
        where += f" ({len(files)} file{'s' * (len(files) > 1)}: {_e(names)}{_e(more)})"
    meta = (f"{where} · {size / 1e6:,.1f} MB · {report.lines:,} lines · "
            f"generated {time.strftime('%Y-%m-%d %H:%M:%S')} · filter: {_e(filter.describe())}"
            f" · tokens: {tokens}")
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{(ASSETS / 'report.css').read_text()}</style>"
        f"</head><body>\n<header><h1>{_e(title)}</h1><p class=\"meta\">{meta}</p>"
        f"{selection_html(selection, max_groups, max_bytes, seed, stats)}</header>\n"
        f"{bad_lines_html(source, report)}"
        f'<section id="stats"><h2>Statistics</h2>{stats_html(stats)}</section>\n'
        '<section id="groups"><h2>Groups</h2><div class="controls">'
        '<input id="q" type="search" placeholder="filter by env or item">'
        '<label>sort <select id="sort"><option value="index">file order</option>'
        '<option value="spread">spread (high first)</option>'
        '<option value="mean">mean outcome (high first)</option>'
        '<option value="mean-asc">mean outcome (low first)</option></select></label>'
        '<span id="count"></span></div>'
        '<div id="list-box"><table id="list"><thead><tr><th>#</th><th>line</th><th>env</th>'
        '<th>item</th><th class="num">n</th><th>outcomes</th><th class="num">mean</th>'
        '<th class="num">spread</th><th class="num">trunc.</th><th class="num">tool err.</th>'
        '<th class="num">policy</th></tr></thead><tbody></tbody>'
        "</table></div></section>\n"
        '<section id="detail"><p class="hint">Click a group to see its members side by side.'
        "</p></section>\n"
        '<div id="tip" hidden></div>\n'
    )
