"""`lachesis inspect` and `lachesis report`: data preparation, bad lines, bounded memory,
the env's report, and the report in a real (headless) Chromium."""

from __future__ import annotations

import asyncio
import re
import shutil
import tracemalloc
from pathlib import Path

import pytest

from environments.framework.base import BaseEnv, TurnLevelRewardMixin
from environments.inspection.data import (
    Filter,
    TokenDecoder,
    compute_stats,
    equal_scores,
    select,
    token_rows,
    turn_rows,
)
from environments.inspection.html_report import write_report
from environments.jsonl_store import ReadReport
from environments.rollout import AssistantTurn, Rollout
from environments.trajectory import ScoredGroup, ScoredTrajectory, TrajectoryFlags
from lachesis.cli import main, process_and_report


def episode(turns: list[str], scores: list[float], tool_results: list[str] | None = None, *,
            advantages: bool = False, truncated: bool = False, tool_errors: int = 0,
            policy_version: int = 3) -> ScoredTrajectory:
    """A multi-turn trajectory whose token ids are the UTF-8 bytes of its text (which is
    what the tiny model's byte-level tokenizer gives), with a few-shot assistant message in
    the prompt, tool results between turns and, optionally, per-token advantages."""
    prompt = "Q: reverse 'loom'. A: <answer>mool</answer>\nQ: reverse 'thread'.\n"
    messages = [{"role": "user", "content": "Q: reverse 'loom'."},
                {"role": "assistant", "content": "<answer>mool</answer>"},
                {"role": "user", "content": "Q: reverse 'thread'."}]
    tokens = list(prompt.encode())
    masks, logprobs, spans = [-100] * len(tokens), [1.0] * len(tokens), []
    for k, text in enumerate(turns):
        ids = list(text.encode())
        spans.append([len(tokens), len(tokens) + len(ids)])
        tokens += ids
        masks += ids
        logprobs += [-0.25 - 0.5 * k] * len(ids)
        messages.append({"role": "assistant", "content": text})
        if tool_results and k < len(tool_results):
            result = tool_results[k]
            messages.append({"role": "tool", "content": result})
            ids = list(f"\n[{result}]\n".encode())
            tokens += ids
            masks += [-100] * len(ids)
            logprobs += [1.0] * len(ids)
    extra = {}
    if advantages:  # +1 on the first turn, -1 on the others, 0 on context
        extra["advantages"] = [0.0] * len(tokens)
        for k, (start, end) in enumerate(spans):
            extra["advantages"][start:end] = [1.0 if k == 0 else -1.0] * (end - start)
    return ScoredTrajectory(
        tokens=tokens, masks=masks, inference_logprobs=logprobs, scores=scores,
        turn_spans=spans, messages=messages, policy_version=policy_version,
        flags=TrajectoryFlags(truncated=truncated, tool_errors=tool_errors), **extra)


def sample_groups() -> list[ScoredGroup]:
    good = episode(['<tool_call>{"name": "reverse"}</tool_call>', "<answer>daerht</answer>"],
                   [0.5, 1.0], ["daerht"], advantages=True)
    bad = episode(['<tool_call>{"nam', "<answer>thread</answer>"], [0.25, 0.0],
                  ["Error: malformed tool call"], advantages=True, tool_errors=1)
    cut = episode(["<answer>dae"], [0.0], truncated=True)
    return [
        ScoredGroup(group_id="g-first", env="reverse_word", item_id="thread",
                    trajectories=[good, bad, cut]),
        ScoredGroup(group_id="g-second", env="reverse_word", item_id="loom",
                    trajectories=[episode(["<answer>mool</answer>"], [1.0]),
                                  episode(["<answer>loom</answer>"], [0.0])]),
        ScoredGroup(group_id="g-other-env", env="arithmetic_tool", item_id="7",
                    trajectories=[ScoredTrajectory(tokens=[1, 2, 3], masks=[-100, 2, 3],
                                                   scores=0.8)]),
    ]


def write_with_bad_lines(path: Path) -> list[ScoredGroup]:
    """Groups on lines 1, 3 and 6; malformed JSON on 2, a contract violation on 4 (a mask
    that is neither -100 nor the token), an empty line 5, a torn last line 7."""
    groups = sample_groups()
    lines = [groups[0].model_dump_json(), '{"group_id": "x", "trajectories": [',
             groups[1].model_dump_json(),
             '{"trajectories": [{"tokens": [1, 2], "masks": [-100, 5], "scores": 1.0}]}', "",
             groups[2].model_dump_json()]
    path.write_text("\n".join(lines) + "\n" + groups[0].model_dump_json()[:50])
    return groups


BAD_LINES = {2: "malformed JSON",
             4: "trajectories[0]: masks[1]: is 5; must be -100 or the token id 2",
             7: "torn final line"}


def test_turn_and_token_rows_line_up_scores_advantages_and_messages():
    t = sample_groups()[0].trajectories[0]
    turns = turn_rows(t)
    # the few-shot assistant message of the prompt is not a turn
    assert [r.message.content for r in turns] == [
        '<tool_call>{"name": "reverse"}</tool_call>', "<answer>daerht</answer>"]
    assert [(r.score, r.advantage, r.policy_version, r.is_last) for r in turns] == [
        (0.5, 1.0, 3, False), (1.0, -1.0, 3, True)]
    assert all(r.n_trained == r.n_tokens == r.end - r.start for r in turns)

    rows = token_rows(t, TokenDecoder())
    first = rows[turns[1].start]
    assert (first.trained, first.logprob, first.advantage, first.turn) == (True, -0.75, -1.0, 1)
    assert first.text == f"⟨{ord('<')}⟩"  # no tokenizer: ids
    context = rows[0]
    assert (context.trained, context.logprob, context.turn) == (False, None, None)
    assert sum(r.trained for r in rows) == sum(r.n_tokens for r in turns)


def test_stats_filters_and_bad_lines_by_line_number(tmp_path):
    path = tmp_path / "groups.jsonl"
    write_with_bad_lines(path)
    report = ReadReport()
    stats = compute_stats(path, report=report)
    assert {b.line_no: b.message for b in report.bad_lines}.keys() == BAD_LINES.keys()
    for bad in report.bad_lines:
        assert BAD_LINES[bad.line_no] in bad.message
    assert (stats.groups, stats.trajectories) == (3, 6)
    assert stats.turns == {1: 4, 2: 2}
    assert (stats.truncated, stats.with_tool_errors, stats.tool_error_rate) == (1, 1, 1 / 6)
    # per-turn means over the 5 trajectories scored per turn (the float-scored one is not)
    assert stats.turn_score_means == [(0, pytest.approx(1.75 / 5), 5), (1, 0.5, 2)]
    assert dict(stats.outcome_histogram) == {"0": 3, "0.8": 1, "1": 2}
    assert stats.envs == {"reverse_word": 2, "arithmetic_tool": 1}

    truncated = compute_stats(path, Filter(flags=("truncated",)))
    assert (truncated.groups, truncated.trajectories) == (1, 1)
    high = compute_stats(path, Filter(env="reverse_word", min_score=0.5))
    assert (high.groups, high.trajectories, high.outcome_min) == (2, 2, 1.0)
    with pytest.raises(ValueError, match="unknown flag 'slow'"):
        Filter(flags=("slow",))


def test_select_embeds_all_or_a_sample_within_the_limits():
    sizes = [100] * 50
    assert select(sizes, max_groups=50, max_bytes=10**6).method == "all"
    first = select(sizes, max_groups=10, max_bytes=10**6, method="first")
    assert first.indices == list(range(10)) and first.limited_by == ["max_groups"]
    sample = select(sizes, max_groups=10, max_bytes=450, method="random", seed=1)
    assert len(sample.indices) == 4 and sample.indices == sorted(sample.indices)
    assert sample.limited_by == ["max_groups", "max_bytes"]
    assert sample.indices != list(range(4))  # sampled, not the head of the file
    assert select(sizes, max_groups=10, max_bytes=450, seed=1).indices == sample.indices
    assert select([10**9], max_groups=5, max_bytes=10).indices == [0]  # never empty


def test_inspect_cli_shows_turns_scores_flags_and_names_bad_lines(tmp_path, capsys):
    path = tmp_path / "groups.jsonl"
    write_with_bad_lines(path)
    assert main(["inspect", str(path), "--limit", "0"]) == 0
    out, err = capsys.readouterr()
    assert ("group #0 · line 1 · reverse_word · item thread · 3 trajectories · policy v3"
            in out)
    assert "trajectory 1 · outcome 0 · 1 tool error" in out
    assert "trajectory 2 · outcome 0 · truncated" in out
    first = sample_groups()[0].trajectories[0]
    trained = sum(m != -100 for m in first.masks)
    assert (f"2 turns · {len(first.tokens)} tokens: {trained} trained, "
            f"{len(first.tokens) - trained} context · policy v3") in out
    assert "score 0.5" in out and "adv +1" in out and "adv -1" in out
    assert "turn 1 (outcome)" in out and "daerht" in out
    assert "group #2 · line 6 · arithmetic_tool" in out
    for line_no, message in BAD_LINES.items():
        assert f"{path}:{line_no}: " in err and message in err
    assert "3 bad lines skipped" in err

    # a file of many bad lines lists the first 20 and counts the rest
    many = tmp_path / "many.jsonl"
    many.write_text(sample_groups()[0].model_dump_json() + "\n" + "{\n" * 25)
    assert main(["inspect", str(many)]) == 0
    _, err = capsys.readouterr()
    assert err.count("malformed JSON") == 20 and "... and 5 more bad lines" in err
    assert "25 bad lines skipped" in err

    assert main(["inspect", str(path), "--flag", "tool-errors"]) == 0
    out, _ = capsys.readouterr()
    assert "trajectory 1 · outcome 0 · 1 tool error" in out
    assert "trajectory 0 · outcome 1 (hidden by the filter)" in out
    assert "group #1" not in out

    assert main(["inspect", str(path), "--group", "g-second"]) == 0
    out, _ = capsys.readouterr()
    assert "group #1 · line 3" in out and "mool" in out and "group #0" not in out
    assert main(["inspect", str(path), "--group", "9"]) == 1
    assert "no group '9'" in capsys.readouterr().err

    assert main(["inspect", str(path), "--stats"]) == 0
    out, _ = capsys.readouterr()
    assert "tool errors" in out and "1 of 6 trajectories (16.7%) · 1 in all" in out
    assert "Per-turn score means" in out and "Outcome distribution" in out

    assert main(["inspect", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err


def test_segmented_trajectory_loads_and_shows_where_a_segment_starts(tmp_path, capsys):
    from environments.jsonl_store import GroupWriter, read_groups

    t = ScoredTrajectory(tokens=[1, 2, 3, 4, 9, 5, 6, 7],
                         masks=[-100, -100, 3, 4, -100, -100, 6, 7],
                         scores=[0.5, 1.0], turn_spans=[[2, 4], [6, 8]], segment_starts=[4])
    assert [(r.segment, r.new_segment) for r in turn_rows(t)] == [(0, False), (1, True)]
    path = tmp_path / "groups.jsonl"
    with GroupWriter(path) as writer:
        writer.append(ScoredGroup(group_id="seg", trajectories=[t]))
    assert list(read_groups(path))[0].trajectories[0] == t
    assert main(["inspect", str(path)]) == 0
    assert "new segment 1" in capsys.readouterr().out


def _load_benchmark():
    from conftest import load_script

    return load_script("benchmarks/report_scale.py")


def test_report_of_a_large_file_streams_with_bounded_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    n_groups = _load_benchmark().generate(path, megabytes=24)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        result = write_report(path, tmp_path / "big.html", max_groups=40, max_mb=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.groups == n_groups and result.stats.trajectories == 8 * n_groups
    assert 1 <= result.embedded <= 40 and result.selection == "random"
    # one group at a time (~0.2 MB of JSON, a few MB as Python objects), never the file
    assert peak < size / 4, f"peak {peak / 1e6:.1f} MB traced for a {size / 1e6:.0f} MB file"
    page = (tmp_path / "big.html").read_text()
    assert (f"Included: {result.embedded} of {n_groups} matching groups, a uniform random "
            "sample (seed 0)") in page
    assert page.count('class="g"') == result.embedded


class ScriptedEnv(TurnLevelRewardMixin, BaseEnv):
    """An env whose rollouts are made up (no inference server): two turns each."""

    name = "scripted"

    async def get_next_item(self):
        return {"id": "item-1"}

    async def collect_trajectory(self, item, *, evaluation=False):
        state = Rollout(messages=[{"role": "user", "content": "hi"}], tools=None)
        state.append([1, 2], sampled=False)
        for k in range(2):
            start = len(state.tokens)
            state.append([10 + k, 11 + k], sampled=True, logprobs=[-0.5, -0.5])
            state.messages.append({"role": "assistant", "content": f"turn {k}"})
            state.turns.append(AssistantTurn((start, start + 2), "stop", [], [], None,
                                             f"turn {k}"))
        return state

    def compute_turn_rewards(self, item, rollout):
        return [0.5, self.rng.random()]


def test_env_process_writes_the_report_next_to_the_jsonl(tmp_path):
    env = ScriptedEnv(ScriptedEnv.config_class(group_size=2))
    out = tmp_path / "scripted.jsonl"
    summary = asyncio.run(process_and_report(env, out, 3))  # lachesis env process
    assert summary["report"] == str(tmp_path / "scripted.html")
    page = Path(summary["report"]).read_text()
    assert "All 3 matching groups are included." in page and page.count('class="g"') == 3


@pytest.mark.needs("chromium")  # (skips without it: tests/system_packages.py)
def test_report_in_headless_chromium(tmp_path, tiny_model_dir):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    from playwright.sync_api import sync_playwright  # the `dev` extra

    path = tmp_path / "groups.jsonl"
    write_with_bad_lines(path)
    assert main(["report", str(path), "-o", str(tmp_path / "report.html"),
                 "--tokenizer", str(tiny_model_dir)]) == 0
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"request {r.url}"))
            html = (tmp_path / "report.html").read_text()
            assert not re.search(r"\b(src|href)=", html)  # nothing to fetch: works offline
            page.goto((tmp_path / "report.html").as_uri())
            # the list, from the summary; bad lines named by line number
            rows = page.locator("#list tbody tr")
            assert rows.count() == 3
            assert "All 3 matching groups are included." in page.inner_text("#included")
            bad = page.inner_text("#bad-lines")
            for line_no, message in BAD_LINES.items():
                assert f"groups.jsonl:{line_no}" in bad and message in bad

            rows.first.click()  # open group 0: members side by side
            page.wait_for_selector(".member")
            assert page.locator(".member").count() == 3
            scores = page.locator("table.turns td.turn-score").all_inner_texts()
            assert scores == ["0.5", "0.25", "0", "1", "0", ""]  # turn 0 row, turn 1 row
            badges = page.locator(".member >> nth=0").locator(".turnbadge").all_inner_texts()
            assert badges[0].startswith("turn 0 · score 0.5 · adv +1")
            assert badges[1].startswith("turn 1 (outcome) · score 1 · adv -1")
            assert page.locator(".member >> nth=2").locator(".flag").inner_text() == "truncated"

            # the token view: trained vs context, coloured by advantage, logprob on hover
            member = page.locator(".member >> nth=0")
            member.locator("details.tokens summary").click()
            view = member.locator(".tokview")
            first = sample_groups()[0].trajectories[0]
            trained = sum(m != -100 for m in first.masks)
            view.locator("span.r").first.wait_for()  # filled when the details open
            assert view.locator("span.r").count() == trained
            assert view.locator("span.c").count() == len(first.tokens) - trained
            assert "daerht" in view.inner_text()  # decoded with the tokenizer
            view.locator("span.r").first.hover()
            tip = page.locator("#tip")
            assert tip.is_visible()
            assert "trained · logprob -0.25 · advantage +1 · turn 0" in tip.inner_text()
            view.locator("span.c").first.hover()
            assert "context (not trained)" in tip.inner_text()
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)

            # a directory's report: each group located by its file and line
            logs = tmp_path / "logs"
            logs.mkdir()
            for name, group in zip(["b.jsonl", "a.jsonl"], sample_groups()):
                (logs / name).write_text(group.model_dump_json() + "\n")
            assert main(["report", str(logs)]) == 0
            page.goto((logs / "report.html").as_uri())
            assert page.locator("#list tbody tr td:nth-child(2)").all_inner_texts() == [
                "a.jsonl:1", "b.jsonl:1"]
            page.locator("#list tbody tr").first.click()
            page.wait_for_selector(".member")
            assert page.inner_text("#detail h2").startswith("Group #0 · a.jsonl:1 · reverse_word")
        finally:
            browser.close()
    assert errors == []
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_a_directory_is_read_file_by_file_in_name_order(tmp_path, capsys):
    groups = sample_groups()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "b.jsonl").write_text(groups[2].model_dump_json() + "\n")
    (logs / "a.jsonl").write_bytes(groups[0].model_dump_json().encode() + b"\n\xff\xd8\xff\n"
                                   + groups[1].model_dump_json().encode() + b"\n")
    (logs / "notes.txt").write_text("not a JSONL file\n")
    assert main(["inspect", str(logs), "--limit", "0"]) == 0
    out, err = capsys.readouterr()
    first, second, third = (out.index(f"group #{i} · ") for i in range(3))
    assert first < second < third
    assert "group #0 · a.jsonl:1 · reverse_word" in out
    assert "group #1 · a.jsonl:3 · reverse_word" in out
    assert "group #2 · b.jsonl:1 · arithmetic_tool" in out
    assert f"{logs / 'a.jsonl'}:2: not UTF-8 text: byte 0xff at byte 1" in err
    assert "1 bad line skipped" in err

    assert main(["inspect", str(logs), "--stats"]) == 0
    assert re.search(r"groups\s+3 \(filter: none\)", capsys.readouterr().out)

    assert main(["report", str(logs)]) == 0
    out, err = capsys.readouterr()
    assert f"{logs / 'a.jsonl'}:2: not UTF-8 text" in err
    page = (logs / "report.html").read_text()
    assert "(2 files: a.jsonl, b.jsonl)" in page
    assert '"a.jsonl:3"' in page and '"b.jsonl:1"' in page  # the list's location column
    assert "<code>a.jsonl:2</code>: not UTF-8 text" in page

    # a `lachesis run` directory: its trajectories/
    run = tmp_path / "runs" / "demo"
    (run / "trajectories").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "trajectories" / "reverse_word.jsonl").write_text(
        groups[1].model_dump_json() + "\n")
    assert main(["inspect", str(run)]) == 0
    assert "group #0 · reverse_word.jsonl:1 · reverse_word · item loom" in capsys.readouterr().out

    # nothing to read: the error names the path and says why
    assert main(["inspect", str(run / "logs")]) == 2
    assert f"{run / 'logs'}: a directory without *.jsonl files" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such file or directory" in capsys.readouterr().err


def test_binary_garbage_is_named_by_file_and_line_and_the_good_groups_are_kept(tmp_path,
                                                                              capsys):
    path = tmp_path / "mixed.jsonl"
    groups = sample_groups()
    path.write_bytes(groups[0].model_dump_json().encode() + b"\n"
                     + bytes(range(256)).replace(b"\n", b"") + b"\n"
                     + groups[1].model_dump_json().encode() + b"\n")
    assert main(["inspect", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "group #0 · line 1" in out and "group #1 · line 3" in out
    assert f"{path}:2: not UTF-8 text: byte 0x80 at byte 128 of the line" in err
    assert "surrogates" not in err and "1 bad line skipped" in err
    assert main(["report", str(path)]) == 0
    assert f"{path}:2: not UTF-8 text" in capsys.readouterr().err

    garbage = tmp_path / "garbage.jsonl"  # nothing but binary data: status 1
    garbage.write_bytes(bytes(range(128, 256)) * 3 + b"\n")
    assert main(["inspect", str(garbage)]) == 1
    assert f"{garbage}:1: not UTF-8 text: byte 0x80 at byte 1" in capsys.readouterr().err


def test_policy_versions_are_listed_in_numeric_order(tmp_path, capsys):
    path = tmp_path / "versions.jsonl"
    versions = [2, 10, 1, 20, 11, None, 3]
    path.write_text("".join(
        ScoredGroup(group_id=f"v{v}", trajectories=[ScoredTrajectory(
            tokens=[1, 2, 3], masks=[-100, 2, 3], scores=0.5, policy_version=v)]
        ).model_dump_json() + "\n" for v in versions))
    stats = compute_stats(path)
    assert list(stats.policy_versions) == ["1", "2", "3", "10", "11", "20", "none"]
    listed = "1 (1), 2 (1), 3 (1), 10 (1), 11 (1), 20 (1), none (1)"
    assert main(["inspect", str(path), "--stats"]) == 0
    assert listed in capsys.readouterr().out
    result = write_report(path, tmp_path / "versions.html")
    assert listed in result.path.read_text()


def test_equal_score_groups_have_one_definition():
    def group(*scores) -> list[ScoredTrajectory]:
        return [ScoredTrajectory(tokens=[1, 2], masks=[-100, 2], scores=s) for s in scores]

    assert equal_scores(group(1.0, 1.0, 1.0)) and equal_scores(group(0.3, 0.1 + 0.2))
    assert not equal_scores(group(1.0)) and not equal_scores(group(1.0, 0.0))

    def turns(*rows) -> list[ScoredTrajectory]:
        return [episode(["a"] * len(row), list(row)) for row in rows]

    assert equal_scores(turns([0.5, 1.0], [0.5, 1.0]))
    # equal outcomes, different turn scores: MT-GRPO still has a turn-level signal
    assert not equal_scores(turns([0.5, 1.0], [0.0, 1.0]))
    assert not equal_scores(turns([0.0], [0.0, 0.0]))  # a different number of turns


class PatternEnv(ScriptedEnv):
    """Item k's group is scored by PATTERNS[k]: the members' turn scores, in order."""

    PATTERNS = [[[0.5, 1.0], [0.5, 1.0]],   # equal scores: no signal
                [[0.5, 1.0], [0.0, 1.0]],   # equal outcomes, different turn scores
                [[0.5, 1.0], [0.5, 0.0]]]   # different outcomes

    def __init__(self, config):
        super().__init__(config)
        self.items = 0
        self.scored: dict[str, int] = {}

    async def get_next_item(self):
        self.items += 1
        return {"id": f"item-{self.items - 1}"}

    def compute_turn_rewards(self, item, rollout):
        k = int(item["id"].split("-")[1])
        member = self.scored[item["id"]] = self.scored.get(item["id"], -1) + 1
        return self.PATTERNS[k][member]


def test_env_process_and_inspect_count_the_same_equal_score_groups(tmp_path, capsys):
    env = PatternEnv(PatternEnv.config_class(group_size=2, keep_equal_score_groups=True,
                                             concurrency=1))
    out = tmp_path / "patterns.jsonl"
    summary = asyncio.run(process_and_report(env, out, 3))
    assert summary["groups_sent"] == 3 and summary["groups_kept_equal_scores"] == 1
    assert main(["inspect", str(out), "--stats"]) == 0
    out_text = capsys.readouterr().out
    assert re.search(r"equal-score groups\s+1 of 3 \(every trajectory scored the same, turn by "
                     r"turn", out_text)
    assert compute_stats(out).equal_score_groups == 1
    page = Path(summary["report"]).read_text()
    assert "3 (1 with equal scores: every trajectory scored the same, turn by turn" in page
