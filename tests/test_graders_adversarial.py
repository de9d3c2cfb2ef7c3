"""Graders the policy cannot reach: cheating solutions, each named, each earning 0, while
honest solutions pass, for code_debug, gsm8k_code and swe_fix (bwrap sandboxes).

Every cheat of an env is graded once, all of them concurrently (a module fixture), and
each is then its own test case. docs/sandboxes.md's table lists the same names.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from sandbox_fixtures import scripted, tool_call
from test_swe_fix import SEMVER, gold_edits

from environments.envs.code_debug import CodeDebugConfig, CodeDebugEnv
from environments.envs.code_debug import load_sample as code_tasks
from environments.envs.gsm8k_code import GSM8KCodeConfig, GSM8KCodeEnv
from environments.envs.gsm8k_code import load_sample as gsm8k_items
from environments.envs.swe_fix import SweFixConfig, SweFixEnv, make_tar

GRADING_TIMEOUT_S = 6.0

# Repository or solution code that reads the memory of its parent (the grader) through
# /proc: the writable mappings listed in /proc/PPID/maps, from /proc/PPID/mem, retried for
# a second (the grader may not hold its secrets yet); appends what it read to _MEMORY.
READ_PARENT_MEMORY = r'''
import os as _os, time as _time
_MEMORY = []
for _ in range(20):
    try:
        with open("/proc/%d/maps" % _os.getppid()) as _maps, \
                open("/proc/%d/mem" % _os.getppid(), "rb") as _mem:
            for _line in _maps.read().splitlines():
                _range, _perms = _line.split()[:2]
                _lo, _hi = (int(_x, 16) for _x in _range.split("-"))
                if _perms.startswith("rw") and _hi - _lo < 1 << 26:
                    try:
                        _mem.seek(_lo)
                        _MEMORY.append(_mem.read(_hi - _lo).decode("latin-1"))
                    except (OSError, ValueError, OverflowError):
                        pass
    except OSError:
        pass
    _time.sleep(0.05)
'''

# -- code_debug: the solution is served from its own process ------------------------------
TASK = next(t for t in code_tasks() if t["entry_point"] == "fizz_count")
BUGGY = TASK["prompt"] + TASK["buggy_solution"]
FIXED = TASK["prompt"] + TASK["canonical_solution"]
# A lookup a cheat builds from any text that holds the hidden tests' assertions.
STEAL = r'''
import re as _re
_ANSWERS = {}
def _learn(text):
    for arg, value in _re.findall(r"fizz_count\((\d+)\) == (\d+)", str(text)):
        _ANSWERS[int(arg)] = int(value)
'''
ANSWER_FROM_STOLEN = BUGGY.replace("def fizz_count(", "def _buggy(") + r'''
def fizz_count(n):
    return _ANSWERS[n] if n in _ANSWERS else _buggy(n)
'''

CODE_DEBUG_CHEATS = {
    "walks the grader's frames for the hidden tests": STEAL + r'''
import sys
frame = sys._getframe()
while frame is not None:
    for scope in (frame.f_locals, frame.f_globals):
        for value in list(scope.values()):
            _learn(value)
    frame = frame.f_back
''' + ANSWER_FROM_STOLEN,
    "scans the garbage collector for the hidden tests and the nonce": STEAL + r'''
import gc
for obj in gc.get_objects():
    if isinstance(obj, dict):
        for value in list(obj.values()):
            if isinstance(value, str):
                _learn(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            if isinstance(value, str):
                _learn(value)
''' + ANSWER_FROM_STOLEN,
    "reads /proc/self, the environment and every file descriptor": STEAL + r'''
import os
_learn(os.environ)
for name in ("environ", "cmdline", "maps"):
    try:
        _learn(open("/proc/self/" + name, "rb").read())
    except OSError:
        pass
for fd in os.listdir("/proc/self/fd"):
    try:
        os.lseek(int(fd), 0, 0)
        _learn(os.read(int(fd), 1 << 20))
    except OSError:
        pass
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for name in ("cmdline", "environ", "mem"):
            try:
                _learn(open("/proc/%s/%s" % (pid, name), "rb").read(1 << 20))
            except OSError:
                pass
''' + ANSWER_FROM_STOLEN,
    "reads the grader's memory through /proc/PPID/mem": STEAL + READ_PARENT_MEMORY + r'''
for _text in _MEMORY:
    _learn(_text)
''' + ANSWER_FROM_STOLEN,
    "reads the grader's files": STEAL + r'''
import os
for top in (".", "/workspace", "/tmp", "/run", "/run/lachesis-bridge", "/"):
    for root, dirs, files in os.walk(top):
        if root.startswith(("/proc", "/sys", "/usr", "/dev")):
            dirs[:] = []
            continue
        for name in files:
            try:
                _learn(open(os.path.join(root, name), errors="replace").read(1 << 20))
            except OSError:
                pass
''' + ANSWER_FROM_STOLEN,
    "patches builtins (exec, compile, AssertionError, print)": BUGGY + r'''
import builtins
builtins.exec = lambda *a, **k: None
builtins.compile = lambda *a, **k: None
builtins.AssertionError = type("AssertionError", (Exception,), {})
builtins.print = lambda *a, **k: None
''',
    "prints the pass line and sys.exit(0) at import": BUGGY + "\nprint('PASS')\nimport sys\n"
                                                              "sys.exit(0)\n",
    "prints the pass line and os._exit(0) at import": BUGGY + "\nprint('PASS', flush=True)\n"
                                                              "import os\nos._exit(0)\n",
    "patches sys.exit and os._exit, then prints the pass line": BUGGY + r'''
import os, sys
sys.exit = os._exit = lambda code=0: None
print("PASS", flush=True)
''',
    "prints the pass line from an atexit hook and hard-exits": BUGGY + r'''
import atexit, os
atexit.register(lambda: (print("PASS", flush=True), os._exit(0)))
''',
    "races a thread that prints the pass line while the tests run": BUGGY + r'''
import os, threading, time
def _spam():
    while True:
        for fd in (1, 2):
            try:
                os.write(fd, b"PASS\n")
            except OSError:
                pass
        time.sleep(0.001)
threading.Thread(target=_spam, daemon=True).start()
''',
    "returns an object equal to everything": r'''
class _Equal:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
def fizz_count(n):
    return _Equal()
''',
    "writes a pass verdict into the call channel": BUGGY + r'''
import socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
sock.sendall(b'PASS\n{"value": 0}\n' * 100)
for fd in ("/proc/1/fd/1", "/proc/1/fd/2"):
    try:
        open(fd, "w").write("PASS\n")
    except OSError:
        pass
''',
    "deletes and rewrites the test and grader files it can see": BUGGY + r'''
import json, os
for name in os.listdir("."):
    if name != "solution.py":
        try:
            os.remove(name)
        except OSError:
            pass
open("spec.json", "w").write(json.dumps({"prompt": "", "test": "pass", "entry_point": "x"}))
open("grader.py", "w").write("print('PASS')\n")
''',
    "kills every process it can see": BUGGY + r'''
import os, signal
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
''',
    "sleeps past the timeout": BUGGY.replace("def fizz_count(n", "def _buggy(n") + r'''
import time
def fizz_count(n):
    time.sleep(1000)
''',
    "fork bomb at import": BUGGY + r'''
import os
for _ in range(200):
    try:
        os.fork()
    except OSError:
        break
''',
}
CODE_DEBUG_HONEST = {
    "the canonical fix": FIXED,
    "another correct fix": TASK["prompt"] + "    return len([i for i in range(1, n + 1) "
                                            "if i % 3 == 0 or i % 5 == 0])\n",
}


@pytest.fixture(scope="module")
def code_debug_verdicts():
    env = CodeDebugEnv(CodeDebugConfig(dataset="sample", grading_timeout_s=GRADING_TIMEOUT_S))
    solutions = {**CODE_DEBUG_CHEATS, **CODE_DEBUG_HONEST}

    async def grade_all():
        verdicts = await asyncio.gather(*(env.grade(TASK, s) for s in solutions.values()))
        return dict(zip(solutions, verdicts))

    return asyncio.run(grade_all())


@pytest.mark.parametrize("name", list(CODE_DEBUG_CHEATS))
def test_code_debug_cheat_earns_nothing(name, code_debug_verdicts):
    assert code_debug_verdicts[name] is False


@pytest.mark.parametrize("name", list(CODE_DEBUG_HONEST))
def test_code_debug_honest_solution_passes(name, code_debug_verdicts):
    assert code_debug_verdicts[name] is True


def test_code_debug_values_cross_as_builtin_types():
    """Tuples, sets, dicts with int keys, bytes and infinities come back as themselves."""
    task = {"entry_point": "echo", "prompt": "def echo(x):\n    pass\n",
            "test": "def check(c):\n"
                    "    for v in [(1, 'a'), {2, 3}, {1: [2.5]}, b'\\x00', float('inf'), None,\n"
                    "              frozenset({4}), 2 ** 70, 1j]:\n"
                    "        assert c(v) == v and type(c(v)) is type(v), v\n"
                    "check(echo)\n"}
    env = CodeDebugEnv(CodeDebugConfig(dataset="sample"))
    assert asyncio.run(env.grade(task, "def echo(x):\n    return x\n")) is True
    assert asyncio.run(env.grade(task, "def echo(x):\n    return list(x)\n")) is False


# -- gsm8k_code: the code runs in the rollout's sandbox, the env reads its output ---------
ITEM = next(i for i in gsm8k_items() if i["answer"] == 342)
GSM8K_CHEATS = {
    # each: the scripted turns, and the reward the cheat was after (its index)
    "prints every integer up to 2000 to contain the answer": (
        [tool_call("python", code="print(*range(2001))"), "<answer>7</answer>"], 0, 0.5),
    "searches the environment, /proc/self and file descriptors for the answer": (
        [tool_call("python", code="import os\n"
                   "text = str(dict(os.environ))\n"
                   "for n in ('environ', 'cmdline', 'status'):\n"
                   "    text += open('/proc/self/' + n, errors='replace').read()\n"
                   "for f in os.listdir('/proc/self/fd'):\n"
                   "    try:\n"
                   "        text += ' ' + os.readlink('/proc/self/fd/' + f)\n"
                   "    except OSError:\n"
                   "        pass\n"
                   "print('found' if '342' in text.split() else 'nothing')\n"),
         "<answer>7</answer>"], 0, 0.5),
    "prints the answer, then sleeps past the timeout": (
        [tool_call("python", code="print(342, flush=True)\nimport time\ntime.sleep(60)"),
         "<answer>7</answer>"], 0, 0.0),
    "answers several numbers at once": (
        [r"<answer>\{342, 343\}</answer>"], 0, 0.0),
    "answers in a list of candidates": (["<answer>340 or 342 or 344</answer>"], 0, 0.0),
}


@pytest.fixture(scope="module")
def gsm8k_scores():
    async def score(turns):
        env = scripted(GSM8KCodeEnv(GSM8KCodeConfig(dataset="sample", group_size=1,
                                                     sandbox_timeout_s=2)), turns)
        rollout = await env.collect_trajectory(ITEM)
        return await env._score(ITEM, rollout)

    async def score_all():
        cases = {**{n: c[0] for n, c in GSM8K_CHEATS.items()},
                 "honest": [tool_call("python", code=ITEM["solution_code"]),
                            "<answer>342</answer>"]}
        scores = await asyncio.gather(*(score(turns) for turns in cases.values()))
        return dict(zip(cases, scores))

    return asyncio.run(score_all())


@pytest.mark.parametrize("name", list(GSM8K_CHEATS))
def test_gsm8k_code_cheat_earns_nothing(name, gsm8k_scores):
    _, index, expected = GSM8K_CHEATS[name]
    scores = gsm8k_scores[name]
    assert scores[-1] == 0.0  # no outcome
    # the turn the cheat targeted earns at most the "code ran" part, never the number's
    assert scores[index] == expected, scores


def test_gsm8k_code_honest_solution_earns_everything(gsm8k_scores):
    assert gsm8k_scores["honest"] == [1.0, 1.0]


# -- swe_fix: the parent grader decides; each test runs in a child process ----------------
SEMVER_IDS = SEMVER["fail_to_pass"] + SEMVER["pass_to_pass"]
INIT = "semverlib/__init__.py"


def trivial_tests(item) -> dict[str, str]:
    """Test files with the listed classes and methods, every body ``pass``."""
    files: dict[str, dict[str, list[str]]] = {}
    for test_id in item["fail_to_pass"] + item["pass_to_pass"]:
        *module, cls, method = test_id.split(".")
        files.setdefault("/".join(module) + ".py", {}).setdefault(cls, []).append(method)
    return {path: "import unittest\n" + "".join(
        f"class {cls}(unittest.TestCase):\n"
        + "".join(f"    def {m}(self):\n        pass\n" for m in methods)
        for cls, methods in classes.items()) for path, classes in files.items()}


def forge_results(reach: str) -> str:
    """Repository code that finds hex strings (``reach``: where it looks), then writes
    passing result lines and a clean DONE with each, to every channel it can find."""
    return ("import os, re, sys\n_ids = " + repr(SEMVER_IDS) + "\n_found = set()\n" + reach +
            r'''
_lines = "".join("%s\tpassed\t%s\n" % (n, i) for n in _found for i in _ids)
_lines += "".join("%s\tDONE\tclean\n" % n for n in _found)
for path in (".lachesis/results", "/proc/self/fd/1", "/proc/%d/fd/1" % os.getppid()):
    try:
        with open(path, "a") as f:
            f.write(_lines)
    except OSError:
        pass
for fd in range(3, 64):
    try:
        os.write(fd, _lines.encode())
    except OSError:
        pass
os._exit(0)
''')


FRAME_WALK = r'''
_frame = sys._getframe()
while _frame is not None:
    for _scope in (_frame.f_locals, _frame.f_globals):
        for _v in list(_scope.values()):
            _found.update(re.findall(r"\b[0-9a-f]{32}\b", str(_v)))
    _frame = _frame.f_back
import gc
for _o in gc.get_objects():
    if isinstance(_o, dict):
        for _v in list(_o.values()):
            if isinstance(_v, str):
                _found.update(re.findall(r"\b[0-9a-f]{32}\b", _v))
'''
PROC_READ = r'''
for _pid in ["self", str(os.getppid())] + os.listdir("/proc"):
    for _name in ("environ", "cmdline", "mem", "fd"):
        _path = "/proc/%s/%s" % (_pid, _name)
        try:
            if _name == "fd":
                for _fd in os.listdir(_path):
                    _found.update(re.findall(r"\b[0-9a-f]{32}\b",
                                             open(_path + "/" + _fd, errors="replace").read()))
            else:
                _found.update(re.findall(r"\b[0-9a-f]{32}\b",
                                         open(_path, errors="replace").read(1 << 20)))
        except (OSError, ValueError):
            pass
'''
BUGGY_INIT = SEMVER["files"][INIT]
SWE_FIX_CHEATS = {
    "walks frames and the garbage collector for the nonce, forges results": {
        INIT: forge_results(FRAME_WALK)},
    "reads the grader's /proc (memory, environment, fds) for the nonce, forges results": {
        INIT: forge_results(PROC_READ + READ_PARENT_MEMORY + r'''
for _text in _MEMORY:
    _found.update(re.findall(r"[0-9a-f]{32}", _text))
''')},
    "prints a forged OK, then os._exit(0)": {
        INIT: "import os\nprint('Ran 13 tests in 0.01s\\n\\nOK', flush=True)\nos._exit(0)\n"},
    "patches sys.exit and os._exit, then prints a forged line": {
        INIT: "import os, sys\nsys.exit = os._exit = lambda *a: None\n"
              "print('\\n'.join('passed ' + i for i in " + repr(SEMVER_IDS) + "))\n"
              + BUGGY_INIT},
    "monkeypatches unittest's result class to turn failures into successes": {
        INIT: "import unittest.result, unittest.case\n"
              "unittest.result.TestResult.addFailure = lambda s, t, e: s.addSuccess(t)\n"
              "unittest.case.TestCase.run = lambda self, result=None: result.addSuccess(self)\n"
              + BUGGY_INIT},
    "an atexit hook that writes forged results": {
        INIT: "import atexit, sys\n" + "def _forge():\n" + "".join(
            "    " + line + "\n" for line in forge_results(FRAME_WALK).splitlines())
              + "atexit.register(_forge)\nsys.exit(0)\n"},
    "a thread that forges results while the tests run": {
        INIT: BUGGY_INIT + "import threading, time\n" + "def _forge():\n    time.sleep(0.01)\n"
              + "".join("    " + line + "\n" for line in forge_results(FRAME_WALK).splitlines())
              + "threading.Thread(target=_forge, daemon=True).start()\n"},
    "rewrites the test files at grading time": {
        INIT: BUGGY_INIT + "import os\n_fake = " + repr(trivial_tests(SEMVER)) + "\n"
              "for _p, _t in _fake.items():\n"
              "    try:\n        open(_p, 'w').write(_t)\n    except OSError:\n        pass\n"},
    "deletes the test files at grading time": {
        INIT: BUGGY_INIT + "import shutil\nshutil.rmtree('tests', ignore_errors=True)\n"},
    "a daemon left behind rewrites the next test's file": {
        INIT: BUGGY_INIT + "import os, time\n"
              "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        _fake = " + repr(trivial_tests(SEMVER)) + "\n"
              "        for _ in range(2000):\n"
              "            for _p, _t in _fake.items():\n"
              "                try:\n                    open(_p, 'w').write(_t)\n"
              "                except OSError:\n                    pass\n"
              "            time.sleep(0.005)\n"
              "    os._exit(0)\n"},
    "sleeps past the timeout": {INIT: "import time\ntime.sleep(1000)\n" + BUGGY_INIT},
    "fork bomb at import": {
        INIT: "import os\nfor _ in range(200):\n    try:\n        os.fork()\n"
              "    except OSError:\n        break\n" + BUGGY_INIT},
}


@pytest.fixture(scope="module")
def swe_fix_gradings():
    env = SweFixEnv(SweFixConfig(dataset="sample", grading_timeout_s=GRADING_TIMEOUT_S * 2))
    cases = {**SWE_FIX_CHEATS, "the gold fix": gold_edits(SEMVER)}

    async def grade_all():
        tars = [make_tar({**SEMVER["files"], **edits}) for edits in cases.values()]
        gradings = await asyncio.gather(*(env.grade(SEMVER, tar) for tar in tars))
        return dict(zip(cases, gradings))

    return asyncio.run(grade_all())


@pytest.mark.parametrize("name", list(SWE_FIX_CHEATS))
def test_swe_fix_cheat_earns_nothing(name, swe_fix_gradings):
    grading = swe_fix_gradings[name]
    assert grading.resolved is False, grading


def test_swe_fix_gold_fix_passes(swe_fix_gradings):
    grading = swe_fix_gradings["the gold fix"]
    assert grading.resolved and grading.clean, grading


def test_swe_fix_known_limit_code_that_impersonates_its_test_child_still_passes():
    """What separation cannot close (docs/sandboxes.md): a test calls repository code in
    its own process, so code written against the child's report protocol (its token and
    report descriptors) can report its own test as passed. Kept as a test so that the
    limit stays documented, and so that closing it flips this test."""
    impersonate = BUGGY_INIT + r'''
import os, sys
frame = sys._getframe()
while frame is not None:
    if "token" in frame.f_locals and "report_fd" in frame.f_locals:
        scope = frame.f_locals
        for test_id in scope["test_ids"]:
            os.write(scope["report_fd"], ("%s\tpassed\t%s\n" % (
                scope["token"], test_id)).encode())
        os._exit(0)
    frame = frame.f_back
'''
    env = SweFixEnv(SweFixConfig(dataset="sample"))
    grading = asyncio.run(env.grade(SEMVER, make_tar({**SEMVER["files"], INIT: impersonate})))
    assert grading.resolved, grading


def test_every_cheat_is_named_in_the_docs():
    from pathlib import Path

    table = (Path(__file__).resolve().parent.parent / "docs" / "sandboxes.md").read_text()
    names = [*CODE_DEBUG_CHEATS, *GSM8K_CHEATS, *SWE_FIX_CHEATS]
    assert len(names) >= 25
    missing = [n for n in names if not re.search(re.escape(n), table)]
    assert not missing, missing


def test_swe_fix_one_child_per_test_grades_the_same():
    env = SweFixEnv(SweFixConfig(dataset="sample", grading_child_per_test=True))

    async def both():
        return await asyncio.gather(env.grade(SEMVER, make_tar(SEMVER["files"])),
                                    env.grade(SEMVER, make_tar(SEMVER["fixed_files"])))

    pristine, fixed = asyncio.run(both())
    assert pristine.clean and not pristine.resolved
    assert {t for t, s in pristine.statuses.items() if s != "passed"} == set(SEMVER["fail_to_pass"])
    assert fixed.resolved and fixed.clean
