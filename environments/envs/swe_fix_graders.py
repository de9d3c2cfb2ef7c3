"""The grader scripts of ``swe_fix``: they run inside a fresh grading sandbox, as
``python -I /workspace/.lachesis/grader.py`` with the repository as working directory.

Both read a random nonce (and delete its file) and open their results file before any
code of the repository is imported, then write one line per test,
``NONCE<TAB>STATUS<TAB>TEST_ID``, and a last line ``NONCE<TAB>DONE<TAB>clean`` (or
``tampered``). ``-I`` keeps the repository (and ``$HOME``'s user site) off ``sys.path``
at start-up, so nothing of it (a ``sitecustomize.py``, a ``.pth``) runs before the grader;
the grader then puts the repository first on ``sys.path`` itself. Before and after the
tests it checks that the test machinery was not patched (every attribute the watched
classes and modules had when the grader started is still the very same object), with
helpers bound before the repository's code could replace them. Limits: see the module
docstring of :mod:`environments.envs.swe_fix`.
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

UNITTEST_CHILD = _COMMON + r'''
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


def child(token_fd, report_fd, test_id, read=os.read, close=os.close, write=os.write,
          exit=os._exit, Exception=BaseException):
    token = read(token_fd, 64).decode()
    close(token_fd)
    try:
        status = run_one(test_id)
    except Exception:
        status = "error"
    write(report_fd, ("%s\t%s\t%s\n" % (token, status, test_id)).encode("utf-8", "replace"))
    exit(0)  # no atexit hook, no thread of the repository's, runs after the report


child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
'''

UNITTEST_GRADER = _COMMON + r'''
import ctypes
import hashlib
import secrets
import select
import signal
import tempfile
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
        time.sleep(0.01)


def run_child(test_id, deadline, log):
    """Run one test in a child process; its status, from the child's report line (with
    the per-test token) and its exit status."""
    token = secrets.token_hex(16)
    cache = tempfile.mkdtemp()  # no bytecode a previous test's child could have planted
    token_r, token_w = os.pipe()
    report_r, report_w = os.pipe()
    os.write(token_w, token.encode())
    os.close(token_w)
    try:
        pid = os.fork()
    except OSError:
        os.close(token_r), os.close(report_r), os.close(report_w)
        return "error"
    if pid == 0:
        try:
            os.setsid()
            os.dup2(log, 1)
            os.dup2(log, 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd in range(3, 1024):
                if fd not in (token_r, report_w):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            os.set_inheritable(token_r, True)
            os.set_inheritable(report_w, True)
            os.execv(sys.executable, [sys.executable, "-I", "-B", "-X",
                                      "pycache_prefix=" + cache, os.path.join(HERE, "child.py"),
                                      str(token_r), str(report_w), test_id])
        finally:
            os._exit(127)
    os.close(token_r)
    os.close(report_w)
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or len(data) > 1 << 16:
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
        time.sleep(0.001)
    kill_descendants()
    if status is not None:
        return status
    lines = data.decode("utf-8", "replace").splitlines()
    if code != 0 or len(lines) != 1:
        return "error"
    parts = lines[0].split("\t", 2)
    if len(parts) != 3 or parts[0] != token or parts[2] != test_id:
        return "error"
    return parts[1]


def main():
    nonce, spec, out = read_setup()
    protect()
    deadline = time.monotonic() + float(spec.get("timeout_s", 60))
    protected = spec.get("protect", [])
    pristine = fingerprint(protected)
    log = os.open(os.path.join(HERE, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    clean = pristine is not None
    for test_id in spec["tests"]:
        if clean and fingerprint(protected) != pristine:
            clean = False  # a test's child rewrote, moved or deleted a test file
        status = run_child(test_id, deadline, log) if clean else "tampered"
        if clean and fingerprint(protected) != pristine:
            clean, status = False, "tampered"
        emit(out, nonce, status, test_id)
    emit(out, nonce, "DONE", "clean" if clean else "tampered")


main()
'''

PYTEST_GRADER = _COMMON + r'''
def main(isinstance=isinstance, list=list, Exception=BaseException):
    nonce, spec, out = read_setup()
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
    clean = True
    try:
        pytest.main(["-p", "no:cacheprovider", "--rootdir", ROOT, "-q", *spec["files"]],
                     plugins=[Recorder()])
    except Exception:
        pass
    if not intact(watched):
        clean = False
    for test_id in spec["tests"]:
        emit(out, nonce, statuses.get(test_id, "not_found") if clean else "tampered", test_id)
    emit(out, nonce, "DONE", "clean" if clean else "tampered")


main()
'''
