"""JSONL store: round trip, bad lines with line numbers, torn tails after a crash."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, make_group

from environments.jsonl_store import BadLineError, GroupWriter, ReadReport, read_groups


def test_round_trip(tmp_path):
    path = tmp_path / "groups.jsonl"
    groups = [make_group(3, turn_scores=True, seed=i) for i in range(4)]
    with GroupWriter(path) as writer:
        writer.append(groups[:1])
        writer.append(groups[1:])
    assert list(read_groups(path)) == groups


def test_reads_atropos_scored_data_lines(tmp_path):
    path = tmp_path / "atropos.jsonl"
    path.write_text('{"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [0.5]}\n')
    (group,) = read_groups(path)
    assert group.trajectories[0].scores == 0.5


def test_bad_lines_are_named_and_can_be_skipped(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = [make_group(seed=i) for i in range(3)]
    lines = [good[0].model_dump_json(), "{not json", good[1].model_dump_json(),
             '{"trajectories": []}', good[2].model_dump_json()]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadLineError, match=r"mixed.jsonl:2: malformed JSON"):
        list(read_groups(path))
    report = ReadReport()
    assert list(read_groups(path, skip_bad=True, report=report)) == good
    assert [b.line_no for b in report.bad_lines] == [2, 4]
    assert report.bad_lines[0].message.startswith("malformed JSON")
    assert report.bad_lines[1].message.startswith("trajectories: List should have at least 1 item")


def test_binary_garbage_is_a_bad_line_naming_the_byte_and_the_good_lines_survive(tmp_path):
    path = tmp_path / "garbage.jsonl"
    good = [make_group(seed=i) for i in range(2)]
    path.write_bytes(good[0].model_dump_json().encode() + b"\n"
                     + b"\x89PNG\r\x1a\x00\xff\xfe garbage\n"             # binary data
                     + good[1].model_dump_json().encode() + b"\n"
                     + b'{"group_id": "caf\xe9", "trajectories": []}\n')  # Latin-1, not UTF-8
    with pytest.raises(BadLineError, match=r"garbage.jsonl:2: not UTF-8 text: byte 0x89 at "
                                           r"byte 1 of the line"):
        list(read_groups(path))
    report = ReadReport()
    assert list(read_groups(path, skip_bad=True, report=report)) == good
    assert [(b.line_no, b.path) for b in report.bad_lines] == [(2, path), (4, path)]
    assert report.bad_lines[1].message.startswith("not UTF-8 text: byte 0xe9 at byte 18 ")
    assert not any("surrogates" in b.message for b in report.bad_lines)
    assert (report.lines, report.groups) == (4, 2)


def test_torn_tail_is_set_aside_before_the_next_append(tmp_path):
    path = tmp_path / "torn.jsonl"
    groups = [make_group(seed=i) for i in range(3)]
    with GroupWriter(path) as writer:
        writer.append(groups[:2])
    with path.open("ab") as f:  # what a crash in the middle of a write leaves
        f.write(groups[2].model_dump_json().encode()[:40])
    report = ReadReport()
    assert list(read_groups(path, skip_bad=True, report=report)) == groups[:2]
    assert "torn final line" in report.bad_lines[0].message
    with GroupWriter(path) as writer:
        writer.append(groups[2])
    assert list(read_groups(path)) == groups  # strict read: nothing torn left inside
    assert (tmp_path / "torn.jsonl.torn").read_bytes().startswith(b'{"group_id"')


WRITER = """
import sys
sys.path.insert(0, "tests")
from conftest import make_group
from environments.jsonl_store import GroupWriter
with GroupWriter(sys.argv[1], fsync=False) as w:
    i = 0
    while True:
        w.append([make_group(8, 2000, seed=i)])
        i += 1
"""


def test_killed_writer_never_leaves_a_torn_line_inside(tmp_path):
    path = tmp_path / "crash.jsonl"
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO)
        time.sleep(1.0 + 0.37 * round_)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # Whatever the kill interrupted, the next writer repairs the tail first.
        with GroupWriter(path) as writer:
            writer.append(make_group(seed=10_000 + round_))
        groups = list(read_groups(path))  # strict: raises on any bad line
        assert groups[-1].trajectories[0].tokens == make_group(seed=10_000 + round_).trajectories[0].tokens


def test_concurrent_deliveries_to_one_file_keep_every_group(tmp_path):
    """An env server hands each finished group to its JSONL file from a worker thread
    (``lachesis env process``, a run's trajectories/*.jsonl), so several appends to one
    writer can run at once: every group is kept whole, none is set aside as torn."""
    import asyncio

    from environments.framework.delivery import JSONLDelivery

    path = tmp_path / "groups.jsonl"
    groups = [make_group(8, 400, seed=i) for i in range(200)]

    async def deliver():
        delivery = JSONLDelivery(path)
        try:
            await asyncio.gather(*(delivery.send(group) for group in groups))
        finally:
            await delivery.close()

    asyncio.run(deliver())
    assert sorted(g.group_id for g in read_groups(path)) == sorted(g.group_id for g in groups)
    assert not (tmp_path / "groups.jsonl.torn").exists()
