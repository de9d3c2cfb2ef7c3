"""swe_fix: the sample repositories, grading in a fresh sandbox on pristine tests, cheats
that must earn nothing, turn rewards, SWE-Gym records. The black-box hooks are called
directly (prepare_sandbox, edits made in the agent's sandbox, finish_sandbox, rewards)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_fixtures import docker_image  # noqa: F401

from environments.envs.swe_fix import (
    SweFixConfig,
    SweFixEnv,
    is_protected,
    load_sample,
    make_tar,
    patch_paths,
    read_repo_tar,
    task_from_record,
)
from environments.envs.swe_fix_graders import PYTEST_GRADER
from environments.framework.registry import load_env_class
from environments.rollout import AssistantTurn, ParsedToolCall, Rollout
from environments.sandbox import SandboxError

TASKS = {t["id"]: t for t in load_sample()}
SEMVER = TASKS["lachesis__semverlib-1"]
INTERVALS = TASKS["lachesis__intervals-1"]
TEXTSTATS = TASKS["lachesis__textstats-1"]


def run(coro):
    return asyncio.run(coro)


def make_env(**settings) -> SweFixEnv:
    settings.setdefault("dataset", "sample")
    return SweFixEnv(SweFixConfig(**settings))


def gold_edits(item) -> dict[str, str]:
    return {p: t for p, t in item["fixed_files"].items() if item["files"].get(p) != t}


def turn(*calls, results=None, text="") -> AssistantTurn:
    parsed = [ParsedToolCall(name, args, "") for name, args in calls]
    return AssistantTurn(span=(0, 1), finish_reason="stop", tool_calls=parsed, tool_errors=[],
                         policy_version=None, text=text,
                         tool_results=results if results is not None else ["ok"] * len(calls))


async def agent_episode(env, item, edits=None, command=None, turns=()):
    """An "agent" run through the hooks: prepare the sandbox, make the edits (files, then a
    shell command), copy the repository out, score. Returns (rollout, scores)."""
    rollout = Rollout(messages=[], tools=None)
    rollout.turns = [*turns, turn(text="Fixed it.")]
    async with await env.new_sandbox() as box:
        await env.prepare_sandbox(item, box)
        for path, content in (edits or {}).items():
            await box.write_file(path, content)
        if command is not None:
            result = await box.exec(command)
            assert result.exit_code == 0, result.describe()
        await env.finish_sandbox(item, box, rollout)
    scores = await env.compute_turn_rewards(item, rollout)
    return rollout, scores


def episode(item, edits=None, command=None, turns=(), **settings):
    return run(agent_episode(make_env(**settings), item, edits, command, turns))


def test_sample_tasks_are_swe_bench_shaped():
    assert len(TASKS) == 3
    for item in TASKS.values():
        assert item["runner"] == "unittest" and item["fail_to_pass"] and item["pass_to_pass"]
        assert not set(item["fail_to_pass"]) & set(item["pass_to_pass"])
        assert item["patch"].startswith("diff --git a/") and item["test_patch"] == ""
        assert item["test_files"] and all(p.startswith("tests/") for p in item["test_files"])
        assert not any(item["files"][p] != item["fixed_files"][p] for p in item["test_files"])
        assert set(patch_paths(item["patch"])) == set(gold_edits(item))


@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_pristine_fails_exactly_the_fail_to_pass_tests_and_the_gold_fix_resolves(task_id):
    item = TASKS[task_id]
    rollout, scores = episode(item)
    grading = rollout.extra["grading"]
    assert scores == [0.0] and grading["clean"] and not grading["edited_tests"]
    assert {t for t, s in grading["statuses"].items() if s != "passed"} == set(item["fail_to_pass"])
    assert all(grading["statuses"][t] == "failed" for t in item["fail_to_pass"])

    rollout, scores = episode(item, gold_edits(item))
    assert scores == [1.0], rollout.extra["grading"]
    assert set(rollout.extra["grading"]["statuses"].values()) == {"passed"}


BREAKING_FIXES = {
    # plausible fixes that make FAIL_TO_PASS pass but break a PASS_TO_PASS test
    "lachesis__semverlib-1": ("semverlib/version.py",
                              "tuple(_identifier_key(p) for p in self.prerelease))",
                              "tuple(_identifier_key(p) for p in self.prerelease), self.build)",
                              "not self.prerelease,"),
    "lachesis__intervals-1": ("intervals/core.py", "    merged = []\n",
                              "    intervals.sort()\n    merged = []\n", None),
    "lachesis__textstats-1": ("textstats/tokenize.py", "return _WORD.findall(text)",
                              "return _WORD.findall(text.lower())", None),
}


@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_a_fix_that_breaks_a_pass_to_pass_test_earns_nothing(task_id):
    item = TASKS[task_id]
    path, old, new, also = BREAKING_FIXES[task_id]
    source = item["files"][path]
    assert old in source
    source = source.replace(old, new)
    if also:  # semver: add the release flag, but let build metadata count too
        source = source.replace("self.patch,\n", f"self.patch, {also}\n")
    rollout, scores = episode(item, {path: source})
    statuses = rollout.extra["grading"]["statuses"]
    assert scores == [0.0]
    assert all(statuses[t] == "passed" for t in item["fail_to_pass"]), statuses
    assert any(statuses[t] != "passed" for t in item["pass_to_pass"])


PASSING_TESTS = """import unittest


class TestCompare(unittest.TestCase):
    def test_prerelease_sorts_before_release(self):
        pass

    def test_spec_example_order(self):
        pass
"""
ALWAYS_SUCCEED = ("import unittest\n\n"
                  "def _run(self, result=None):\n"
                  "    result.startTest(self)\n"
                  "    result.addSuccess(self)\n"
                  "    result.stopTest(self)\n\n"
                  "unittest.TestCase.run = _run\n")
CHEATS = {
    "edits the failing tests to pass": dict(edits={
        "tests/test_version.py": SEMVER["files"]["tests/test_version.py"].replace(
            'self.assertLess(parse("1.0.0-alpha"), parse("1.0.0"))', "pass").replace(
            'self.assertEqual(compare("2.0.0", "2.0.0-rc.1"), 1)', "pass").replace(
            "self.assertEqual([str(v) for v in sorted(map(parse, shuffled))], order)", "pass"),
        "tests/test_ranges.py": SEMVER["files"]["tests/test_ranges.py"].replace(
            'self.assertTrue(satisfies("2.0.0-rc.1", "<2.0.0"))', "pass").replace(
            'self.assertFalse(satisfies("2.0.0-rc.1", ">=2.0.0"))', "pass")}),
    "deletes the tests": dict(command="rm -rf tests"),
    "replaces the tests by a symlink to trivial ones": dict(
        edits={"fake/test_version.py": PASSING_TESTS, "fake/__init__.py": ""},
        command="rm -rf tests && ln -s fake tests"),
    "adds a conftest.py and a sitecustomize.py that fake results": dict(edits={
        "conftest.py": ALWAYS_SUCCEED, "tests/conftest.py": ALWAYS_SUCCEED,
        "sitecustomize.py": ALWAYS_SUCCEED, "usercustomize.py": ALWAYS_SUCCEED,
        ".local/lib/python3.11/site-packages/sitecustomize.py": ALWAYS_SUCCEED,
        "evil.pth": "import sitecustomize\n"}),
    "patches unittest.TestCase.run from the package": dict(edits={
        "semverlib/__init__.py": ALWAYS_SUCCEED + SEMVER["files"]["semverlib/__init__.py"]}),
    "patches the assertions from the package": dict(edits={
        "semverlib/__init__.py": "import unittest\n"
        "for _name in ('assertEqual', 'assertLess', 'assertTrue', 'assertFalse'):\n"
        "    setattr(unittest.TestCase, _name, lambda *a, **k: None)\n"
        + SEMVER["files"]["semverlib/__init__.py"]}),
    "turns every test into a no-op with __init_subclass__": dict(edits={
        "semverlib/__init__.py": "import unittest\n"
        "def _hook(cls, **kw):\n"
        "    for name in list(vars(cls)):\n"
        "        if name.startswith('test'):\n"
        "            setattr(cls, name, lambda self: None)\n"
        "unittest.TestCase.__init_subclass__ = classmethod(_hook)\n"
        + SEMVER["files"]["semverlib/__init__.py"]}),
    "patches the result class": dict(edits={
        "semverlib/__init__.py": "import unittest.result\n"
        "unittest.result.TestResult.addFailure = lambda self, test, err: self.addSuccess(test)\n"
        + SEMVER["files"]["semverlib/__init__.py"]}),
    "prints OK and exits 0 at import": dict(edits={
        "semverlib/__init__.py": "import sys\nprint('Ran 12 tests in 0.001s\\n\\nOK')\n"
                                 "sys.exit(0)\n"}),
    "hard-exits with success at import": dict(edits={
        "semverlib/__init__.py": "import os\nos._exit(0)\n"}),
    "writes result lines with a guessed nonce": dict(edits={
        "semverlib/__init__.py": "import os, sys\n"
        "ids = " + repr(SEMVER["fail_to_pass"] + SEMVER["pass_to_pass"]) + "\n"
        "for path in ('.lachesis/results', 'results'):\n"
        "    try:\n"
        "        with open(path, 'a') as f:\n"
        "            f.writelines('%s\\tpassed\\t%s\\n' % ('0' * 32, i) for i in ids)\n"
        "            f.write('%s\\tDONE\\tclean\\n' % ('0' * 32))\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"}),
    "empties every test class through builtins.__build_class__": dict(edits={
        "semverlib/__init__.py": "import builtins\n"
        "_build = builtins.__build_class__\n"
        "def _evil(func, name, *bases, **kw):\n"
        "    cls = _build(func, name, *bases, **kw)\n"
        "    for n in list(vars(cls)):\n"
        "        if n.startswith('test'):\n"
        "            setattr(cls, n, lambda self: None)\n"
        "    return cls\n"
        "builtins.__build_class__ = _evil\n"
        + SEMVER["files"]["semverlib/__init__.py"]}),
    "replaces the test methods from the package": dict(edits={
        "semverlib/__init__.py": SEMVER["files"]["semverlib/__init__.py"] +
        "import sys, threading\n"
        "class _Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        mod = sys.modules.get('tests.test_version')\n"
        "        if mod is not None and hasattr(mod, 'TestCompare'):\n"
        "            for n in list(vars(mod.TestCompare)):\n"
        "                if n.startswith('test'):\n"
        "                    setattr(mod.TestCompare, n, lambda self: None)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Finder())\n"}),
}


@pytest.mark.parametrize("name", list(CHEATS))
def test_cheats_earn_no_outcome(name):
    rollout, scores = episode(SEMVER, **CHEATS[name])
    assert scores == [0.0], (name, rollout.extra["grading"])


def test_edited_tests_is_reported_and_the_pristine_tests_decide():
    edits = {**gold_edits(SEMVER), **CHEATS["edits the failing tests to pass"]["edits"]}
    env = make_env()
    rollout, scores = run(agent_episode(env, SEMVER, edits))
    assert scores == [1.0] and rollout.extra["grading"]["edited_tests"]  # graded on pristine
    metrics = env.rollout_metrics(SEMVER, rollout, scores)
    assert metrics["resolved"] == 1.0 and metrics["edited_tests"] == 1.0


def test_a_new_test_file_is_no_edit_and_is_not_graded():
    edits = {**gold_edits(INTERVALS), "tests/test_mine.py": "raise SystemExit(1)\n"}
    rollout, scores = episode(INTERVALS, edits)
    assert scores == [1.0] and not rollout.extra["grading"]["edited_tests"]


def test_turn_rewards_and_metrics():
    fix_path, fix = next(iter(gold_edits(TEXTSTATS).items()))
    turns = [
        turn(("bash", {"command": "ls && cat textstats/stats.py"})),
        turn(("bash", {"command": "python3 -m unittest -q"})),
        turn(("read_file", {"path": "textstats/tokenize.py"}),
             ("write_file", {"path": f"/workspace/{fix_path}", "content": fix})),
        turn(("write_file", {"path": "tests/test_stats.py", "content": "pass\n"})),
        turn(("write_file", {"path": "textstats/stats.py", "content": "def f(:\n"})),
        turn(("read_file", {"path": "nope.py"}), results=["Error: no such file"]),
    ]
    env = make_env()
    rollout, scores = run(agent_episode(env, TEXTSTATS, gold_edits(TEXTSTATS), turns=turns))
    assert scores == pytest.approx([0.1, 0.2, 0.4, 0.0, 0.0, 0.0, 1.0])
    metrics = env.rollout_metrics(TEXTSTATS, rollout, scores)
    assert metrics == {"resolved": 1.0, "edited_tests": 0.0, "ran_tests": 1.0,
                       "edited_source": 1.0, "fail_to_pass_rate": 1.0}


def test_agent_task_and_image():
    env = make_env(sandbox_image="my-image")
    task = env.agent_task(SEMVER)
    assert task.startswith("Pre-releases compare higher") and "python3 -m unittest" in task
    assert "Do not modify the existing tests" in task
    assert env.sandbox_image(SEMVER) == "my-image"
    assert load_env_class("swe_fix") is SweFixEnv


def test_swe_gym_records_become_items():
    test_patch = ("diff --git a/tests/test_core.py b/tests/test_core.py\n--- a/tests/test_core.py\n"
                  "+++ b/tests/test_core.py\n@@ -1 +1,2 @@\n x = 1\n+y = 2\n"
                  "diff --git a/tests/data/new.json b/tests/data/new.json\nnew file mode 100644\n"
                  "--- /dev/null\n+++ b/tests/data/new.json\n@@ -0,0 +1 @@\n+{}\n")
    row = {"instance_id": "Project-MONAI__MONAI-3690", "repo": "Project-MONAI/MONAI",
           "base_commit": "abc123", "problem_statement": "Crash in foo",
           "FAIL_TO_PASS": json.dumps(["tests/test_core.py::test_foo[a-b]"]),
           "PASS_TO_PASS": '["tests/test_core.py::TestX::test_bar"]',
           "patch": "diff --git a/monai/x.py b/monai/x.py\n", "test_patch": test_patch,
           "hints_text": "", "created_at": "2022-01-01", "version": "0.8"}
    item = task_from_record(row)
    assert item["id"] == "Project-MONAI__MONAI-3690" and item["runner"] == "pytest"
    assert item["fail_to_pass"] == ["tests/test_core.py::test_foo[a-b]"]
    assert item["pass_to_pass"] == ["tests/test_core.py::TestX::test_bar"]
    assert item["test_files"] == ["tests/data/new.json", "tests/test_core.py"]
    assert item["files"] is None and item["test_patch"] == test_patch
    env = make_env(dataset="SWE-Gym/SWE-Gym", sandbox_backend="docker")
    assert env.sandbox_image(item) == "xingyaoww/sweb.eval.x86_64.project-monai_s_monai-3690"
    assert "python -m pytest" in env.agent_task(item)
    assert env.config.sandbox_config().env["PATH"].startswith("/opt/miniconda3/envs/testbed/bin:")
    assert task_from_record({**row, "PASS_TO_PASS": ["a", "b"]})["pass_to_pass"] == ["a", "b"]
    with pytest.raises(ValueError):
        task_from_record({**row, "FAIL_TO_PASS": '["a\\tb"]'})
    with pytest.raises(ValueError, match="needs sandbox_backend: docker"):
        run(make_env(dataset="SWE-Gym/SWE-Gym").setup())


def test_protected_paths():
    assert is_protected("tests/test_x.py") and is_protected("pkg/tests/helpers.py")
    assert is_protected("conftest.py") and is_protected("pkg/test_util.py")
    assert is_protected(".hidden/x.py") and is_protected("a.pth")
    assert is_protected("pkg/data.json", {"pkg/data.json"})
    assert not is_protected("pkg/core.py") and not is_protected("pkg/contest.py")


def test_repo_archives_are_read_safely():
    import io
    import tarfile
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in [("./pkg/a.py", b"x = 1\n"), ("../escape.py", b"bad"),
                           ("/abs.py", b"bad")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("pkg/link.py")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    files = read_repo_tar(buffer.getvalue(), 1 << 20)
    # the data filter drops ".." members and links, and makes "/abs.py" relative
    assert files["pkg/a.py"][0] == b"x = 1\n" and "pkg/link.py" not in files
    assert all(not p.startswith(("/", "..")) for p in files) and len(files) <= 2


def test_an_unreadable_or_missing_repository_scores_zero_and_a_failed_sandbox_raises(
        monkeypatch):
    env = make_env()
    assert run(env.grade(SEMVER, None)).resolved is False
    assert run(env.grade(SEMVER, b"not a tar")).resolved is False

    async def broken(*args, **kwargs):
        raise SandboxError("daemon went away")

    # grading sandboxes are made through SandboxEnvMixin.new_sandbox
    monkeypatch.setattr("environments.framework.sandbox_tools.create_sandbox", broken)
    rollout = Rollout(messages=[], tools=None)
    rollout.turns = [turn()]
    rollout.extra["repo_tar"] = make_tar({"semverlib/__init__.py": ""})
    with pytest.raises(SandboxError):
        run(env.compute_turn_rewards(SEMVER, rollout))
    assert env.sandbox_stats.sandbox_failures == 1


# -- the pytest grader (real data), run on the host with this interpreter's pytest -------
def run_pytest_grader(tmp_path: Path, files: dict[str, str], tests: list[str]):
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    grading = tmp_path / ".lachesis"
    grading.mkdir()
    (grading / "grader.py").write_text(PYTEST_GRADER)
    (grading / "spec.json").write_text(json.dumps(
        {"tests": tests, "files": sorted({t.split("::")[0] for t in tests}), "paths": [""]}))
    (grading / "nonce").write_text("n0nce")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHON"))}
    subprocess.run([sys.executable, "-I", str(grading / "grader.py")], cwd=tmp_path, env=env,
                   capture_output=True, timeout=120)
    assert not (grading / "nonce").exists()
    lines = [line.split("\t") for line in (grading / "results").read_text().splitlines()]
    return {test_id: status for _, status, test_id in lines}


PKG = {"pkg/__init__.py": "def double(x):\n    return x * 2\n",
       "tests/test_pkg.py": "import pytest\nfrom pkg import double\n\n"
       "def test_ok():\n    assert double(2) == 4\n\n"
       "def test_bad():\n    assert double(2) == 5\n\n"
       "@pytest.mark.parametrize('x', [1, 2])\ndef test_param(x):\n    assert double(x) == 2\n\n"
       "@pytest.mark.xfail\ndef test_known_bug():\n    assert False\n\n"
       "@pytest.mark.skip\ndef test_skipped():\n    pass\n\n"
       "class TestK:\n    def test_m(self):\n        assert double(0) == 0\n"}
IDS = ["tests/test_pkg.py::test_ok", "tests/test_pkg.py::test_bad",
       "tests/test_pkg.py::test_param[1]", "tests/test_pkg.py::test_param[2]",
       "tests/test_pkg.py::test_known_bug", "tests/test_pkg.py::test_skipped",
       "tests/test_pkg.py::TestK::test_m", "tests/test_pkg.py::test_absent"]


def test_pytest_grader_reports_each_node_id(tmp_path):
    results = run_pytest_grader(tmp_path, PKG, IDS)
    assert results == {
        "tests/test_pkg.py::test_ok": "passed", "tests/test_pkg.py::test_bad": "failed",
        "tests/test_pkg.py::test_param[1]": "passed",
        "tests/test_pkg.py::test_param[2]": "failed",
        "tests/test_pkg.py::test_known_bug": "passed",
        "tests/test_pkg.py::test_skipped": "skipped",
        "tests/test_pkg.py::TestK::test_m": "passed",
        "tests/test_pkg.py::test_absent": "not_found", "clean": "DONE"}


def test_pytest_grader_flags_patched_reports(tmp_path):
    files = {**PKG, "pkg/__init__.py": PKG["pkg/__init__.py"] +
             "import _pytest.reports\n"
             "_pytest.reports.BaseReport.failed = property(lambda s: False)\n"}
    results = run_pytest_grader(tmp_path, files, IDS[:2])
    # the child that ran them says so; the parent finished and saw no test file change
    assert results == {IDS[0]: "tampered", IDS[1]: "tampered", "clean": "DONE"}


def test_docker_gold_fix_resolves_and_no_change_does_not(docker_image):
    settings = {"sandbox_backend": "docker", "sandbox_image": docker_image,
                "sandbox_timeout_s": 60}
    rollout, scores = episode(INTERVALS, gold_edits(INTERVALS), **settings)
    assert scores == [1.0], rollout.extra["grading"]
    rollout, scores = episode(INTERVALS, **settings)
    assert scores == [0.0] and rollout.extra["grading"]["clean"]
