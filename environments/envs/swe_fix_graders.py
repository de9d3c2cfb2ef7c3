"""The grader scripts of ``swe_fix``: they run inside a fresh grading sandbox, as
``python -I /workspace/.lachesis/grader.py`` with the repository as working directory.

Both read a random nonce (and delete its file) and open their results file before any
code of the repository is imported, then write one line per test,
``NONCE<TAB>STATUS<TAB>TEST_ID``, and a last line ``NONCE<TAB>DONE<TAB>clean`` (or
``tampered`` when a test file changed). ``-I`` keeps the repository (and ``$HOME``'s user site) off ``sys.path``
at start-up, so nothing of it (a ``sitecustomize.py``, a ``.pth``) runs before the grader.
Neither imports the repository: both are :data:`_PARENT`, which forks a child per test
module (unittest) or test file (pytest), or per test, that imports it, runs the tests
(``run_group``) and reports back through a pipe. In a child, the test machinery is checked
before and after the tests (every attribute the watched classes and modules had at the start is
still the very same object), with helpers bound before that code could replace them.
Limits: see the module docstring of :mod:`environments.envs.swe_fix`.
"""

from __future__ import annotations

_COMMON = r'''
import builtins
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.getcwd()
STDLIB = os.path.dirname(os.__file__)
TEST_DIRS = ("tests", "test", "testing")


def read_setup(join=os.path.join, remove=os.remove):
    with open(join(HERE, "nonce")) as f:
        nonce = f.read().strip()
    remove(join(HERE, "nonce"))
    import json
    with open(join(HERE, "spec.json")) as f:
        spec = json.load(f)
    out = os.open(join(HERE, "results"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    return nonce, spec, out


def snapshot(classes, modules, dict=dict, vars=vars):
    return ([(c, dict(vars(c))) for c in classes], [(m, dict(vars(m))) for m in modules])


MISSING = object()


def intact(snap, vars=vars, len=len):
    classes, modules = snap
    for owner, saved in classes:
        now = vars(owner)
        if len(now) != len(saved):
            return False
        for key, value in saved.items():
            if now.get(key, MISSING) is not value:
                return False
    for owner, saved in modules:
        now = vars(owner)
        for key, value in saved.items():
            if now.get(key, MISSING) is not value:
                return False
    return True


def is_test_file(path, realpath=os.path.realpath, sep=os.sep, str=str, isinstance=isinstance):
    if not isinstance(path, str):
        return False
    path = realpath(path)
    if not path.startswith(ROOT + sep):
        return False
    parts = path[len(ROOT) + 1:].split(sep)
    name = parts[-1]
    return (any(p in TEST_DIRS for p in parts[:-1]) or name.startswith("test_")
            or name.endswith("_test.py") or name == "conftest.py")


def emit(out, nonce, status, test_id, write=os.write):
    write(out, ("%s\t%s\t%s\n" % (nonce, status, test_id)).encode("utf-8", "replace"))
'''

_PARENT = r'''
import ctypes
import hashlib
import secrets
import select
import signal
import time

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def protect():
    """No process of the sandbox (a test's child runs as the same uid) can read this
    one's memory, file descriptors or environment through /proc, or ptrace it; orphans of
    the children become ours, so they can be killed between tests."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) or libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
        raise SystemExit("prctl failed: errno %d" % ctypes.get_errno())


def fingerprint(paths):
    """A hash of the test files as they are, None when one is a symlink or in one."""
    digest = hashlib.sha256()
    for path in paths:
        full = os.path.join(ROOT, path)
        if os.path.realpath(full) != full:
            return None
        try:
            with open(full, "rb") as f:
                digest.update(path.encode() + b"\0" + f.read() + b"\0")
        except OSError:
            digest.update(path.encode() + b"\0missing\0")
    return digest.hexdigest()


def remove_bytecode():
    """No bytecode that a test's child could have planted for the next one."""
    import shutil
    for root, dirs, _ in os.walk(ROOT):
        if "__pycache__" in dirs:
            shutil.rmtree(os.path.join(root, "__pycache__"), ignore_errors=True)


def kill_descendants():
    """SIGKILL every process whose parent is this one (the subreaper gets the orphans),
    until none is left."""
    me = str(os.getpid())
    for _ in range(1000):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % pid, "rb") as f:
                    ppid = f.read().rsplit(b")", 1)[1].split()[1].decode()
            except (OSError, IndexError):
                continue
            if ppid == me:
                found = True
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not found:
            return
        time.sleep(0.005)


def child(nonce, token_fd, report_fd, test_ids, spec, log):
    """In the forked child, before any code of the repository runs: forget the nonce
    (its only copy is the bytearray), keep only the token pipe, the report pipe and the
    log, then run the tests and report each with the token."""
    nonce[:] = bytes(len(nonce))
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    low, high = sorted((token_fd, report_fd))
    os.closerange(3, low)
    os.closerange(low + 1, high)
    os.closerange(high + 1, 1 << 16)
    token = os.read(token_fd, 64).decode()
    os.close(token_fd)
    try:
        statuses = run_group(test_ids, spec)
    except BaseException:
        statuses = ["error"] * len(test_ids)
    for test_id, status in zip(test_ids, statuses):
        os.write(report_fd, ("%s\t%s\t%s\n" % (token, status, test_id)).encode("utf-8",
                                                                              "replace"))
    os._exit(0)  # no atexit hook, no thread of the repository's, runs after the report


def run_child(nonce, test_ids, spec, deadline, log):
    """Run tests in a forked child; their statuses, from the child's report lines (with a
    token made after the fork, one line per test, in order) and its exit status."""
    token_r, token_w = os.pipe()
    report_r, report_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        for fd in (token_r, token_w, report_r, report_w):
            os.close(fd)
        return ["error"] * len(test_ids)
    if pid == 0:
        try:
            os.close(token_w)
            os.close(report_r)
            child(nonce, token_r, report_w, test_ids, spec, log)
        finally:
            os._exit(127)
    os.close(token_r)
    os.close(report_w)
    token = secrets.token_hex(16)
    os.write(token_w, token.encode())
    os.close(token_w)
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or len(data) > 1 << 20:
            break
        ready, _, _ = select.select([report_r], [], [], left)
        if not ready:
            break
        chunk = os.read(report_r, 4096)
        if not chunk:
            break
        data += chunk
    os.close(report_r)
    status, code = None, -1
    while True:
        waited, code = os.waitpid(pid, os.WNOHANG)
        if waited:
            break
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
            break
        time.sleep(0.0005)
    kill_descendants()
    statuses = []
    for i, line in enumerate(data.decode("utf-8", "replace").splitlines()[:len(test_ids)]):
        parts = line.split("\t", 2)
        if len(parts) != 3 or parts[0] != token or parts[2] != test_ids[i]:
            break
        statuses.append(parts[1])
    if code != 0 and status is None:
        statuses = []  # an honest child always exits 0
    return statuses + [status or "error"] * (len(test_ids) - len(statuses))


def main():
    nonce = bytearray(32)  # the nonce's only copy: read straight into it, zeroed in children
    fd = os.open(os.path.join(HERE, "nonce"), os.O_RDONLY)
    del nonce[os.readv(fd, [nonce]):]
    os.close(fd)
    os.remove(os.path.join(HERE, "nonce"))
    import json
    with open(os.path.join(HERE, "spec.json")) as f:
        spec = json.load(f)
    out = os.open(os.path.join(HERE, "results"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    protect()
    deadline = time.monotonic() + float(spec.get("timeout_s", 60))
    protected = spec.get("protect", [])
    pristine = fingerprint(protected)
    log = os.open(os.path.join(HERE, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    clean = pristine is not None

    def emit_line(status, test_id):
        os.writev(out, [nonce, ("\t%s\t%s\n" % (status, test_id)).encode("utf-8", "replace")])

    groups = {}  # one child per test (per_test) or per test module / file
    for test_id in spec["tests"]:
        key = test_id if spec.get("per_test") else group_of(test_id)
        groups.setdefault(key, []).append(test_id)
    for test_ids in groups.values():
        if clean:
            remove_bytecode()
        if clean and fingerprint(protected) != pristine:
            clean = False  # a test's child rewrote, moved or deleted a test file
        statuses = run_child(nonce, test_ids, spec, deadline, log) if clean else []
        if clean and fingerprint(protected) != pristine:
            clean = False
        if not clean:
            statuses = ["tampered"] * len(test_ids)
        for test_id, status in zip(test_ids, statuses):
            emit_line(status, test_id)
    emit_line("DONE", "clean" if clean else "tampered")


main()
'''

UNITTEST_GRADER = _COMMON + r'''
import unittest
import unittest.case
import unittest.loader
import unittest.result
import unittest.suite


class Result(unittest.result.TestResult):
    def __init__(self):
        super().__init__()
        self.outcomes = []

    def addSuccess(self, test):
        self.outcomes.append(("passed", test.id()))

    def addExpectedFailure(self, test, err):
        self.outcomes.append(("passed", test.id()))

    def addFailure(self, test, err):
        self.outcomes.append(("failed", test.id()))

    def addError(self, test, err):
        self.outcomes.append(("error", "?"))

    def addSkip(self, test, reason):
        self.outcomes.append(("skipped", test.id()))

    def addUnexpectedSuccess(self, test):
        self.outcomes.append(("failed", test.id()))

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self.outcomes.append(("failed", test.id()))


def trusted_class(cls, TestCase=unittest.case.TestCase, vars=vars, getattr=getattr,
                  hasattr=hasattr, is_test_file=is_test_file):
    """Every function of the test's class and its bases comes from a test file (or the
    standard library): no test method replaced by the repository's code."""
    for klass in cls.__mro__:
        if klass is TestCase or klass is object:
            continue
        for value in list(vars(klass).values()):
            func = getattr(value, "__func__", value)
            for _ in range(50):
                if not hasattr(func, "__wrapped__"):
                    break
                func = func.__wrapped__
            code = getattr(func, "__code__", None)
            if code is None:
                continue
            where = code.co_filename
            if not (is_test_file(where) or where.startswith(STDLIB + os.sep)):
                return False
    return True


def run_one(test_id, isinstance=isinstance, list=list, len=len, type=type):
    """The status of one test, run in this process (which imports the repository)."""
    loader = unittest.loader.TestLoader()
    TestCase = unittest.case.TestCase
    watched = snapshot(
        [unittest.case.TestCase, unittest.case._Outcome, unittest.result.TestResult,
         unittest.loader.TestLoader, unittest.suite.TestSuite, unittest.suite.BaseTestSuite,
         unittest.suite._ErrorHolder, Result],
        [builtins, unittest, unittest.case, unittest.result, unittest.loader, unittest.suite,
         sys.modules[__name__]])
    sys.path.insert(0, ROOT)
    suite = loader.loadTestsFromName(test_id)
    tests = list(suite)
    if not intact(watched):
        return "tampered"
    if len(tests) != 1 or not isinstance(tests[0], TestCase) or tests[0].id() != test_id:
        return "not_found"
    if not trusted_class(type(tests[0])):
        return "tampered"
    result = Result()
    suite.run(result)
    outcomes = result.outcomes
    if not intact(watched):
        return "tampered"
    if len(outcomes) == 1 and outcomes[0] == ("passed", test_id):
        return "passed"
    return outcomes[-1][0] if outcomes else "error"


def run_group(test_ids, spec):
    """The statuses of the tests of one module, run in this (forked) process."""
    statuses = []
    for test_id in test_ids:
        try:
            statuses.append(run_one(test_id))
        except BaseException:
            statuses.append("error")
    return statuses


def group_of(test_id):
    return test_id.rsplit(".", 2)[0]


''' + _PARENT

PYTEST_GRADER = _COMMON + r'''
def run_group(test_ids, spec, isinstance=isinstance, list=list, Exception=BaseException):
    """The statuses of the tests of one file, run with pytest in this (forked) process."""
    for path in reversed(spec.get("paths", [""])):
        sys.path.insert(0, os.path.join(ROOT, path) if path else ROOT)
    import pytest
    import _pytest.main
    import _pytest.python
    import _pytest.reports
    import _pytest.runner

    statuses = {}

    class Recorder:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_logreport(self, report):
            nodeid = report.nodeid
            previous = statuses.get(nodeid)
            if report.failed:
                statuses[nodeid] = "failed"
            elif previous == "failed":
                return
            elif report.when == "call":
                if report.passed or (report.skipped and hasattr(report, "wasxfail")):
                    statuses[nodeid] = "passed"
                else:
                    statuses[nodeid] = "skipped"
            elif report.skipped and previous is None:
                statuses[nodeid] = ("passed" if hasattr(report, "wasxfail") else "skipped")

    watched = snapshot(
        [_pytest.reports.TestReport, _pytest.reports.BaseReport, _pytest.runner.CallInfo,
         Recorder],
        [builtins, pytest, _pytest.main, _pytest.python, _pytest.reports, _pytest.runner,
         sys.modules[__name__]])
    files = sorted({t.split("::")[0] for t in test_ids})
    try:
        pytest.main(["-p", "no:cacheprovider", "--rootdir", ROOT, "-q", *files],
                    plugins=[Recorder()])
    except Exception:
        pass
    if not intact(watched):
        return ["tampered"] * len(test_ids)
    return [statuses.get(t, "not_found") for t in test_ids]


def group_of(test_id):
    return test_id.split("::")[0]


''' + _PARENT
