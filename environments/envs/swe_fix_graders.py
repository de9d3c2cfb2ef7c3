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


def main(isinstance=isinstance, list=list, len=len, type=type, Exception=BaseException):
    nonce, spec, out = read_setup()
    loader = unittest.loader.TestLoader()
    TestCase = unittest.case.TestCase
    watched = snapshot(
        [unittest.case.TestCase, unittest.case._Outcome, unittest.result.TestResult,
         unittest.loader.TestLoader, unittest.suite.TestSuite, unittest.suite.BaseTestSuite,
         unittest.suite._ErrorHolder, Result],
        [builtins, unittest, unittest.case, unittest.result, unittest.loader, unittest.suite,
         sys.modules[__name__]])
    sys.path.insert(0, ROOT)
    clean = True
    for test_id in spec["tests"]:
        status = "error"
        try:
            suite = loader.loadTestsFromName(test_id)
            tests = list(suite)
            if not intact(watched):
                clean = False
            if (len(tests) != 1 or not isinstance(tests[0], TestCase)
                    or tests[0].id() != test_id):
                status = "not_found"
            elif not trusted_class(type(tests[0])):
                status = "tampered"
            else:
                result = Result()
                suite.run(result)
                outcomes = result.outcomes
                if not intact(watched):
                    clean = False
                if (len(outcomes) == 1 and outcomes[0][0] == "passed"
                        and outcomes[0][1] == test_id):
                    status = "passed"
                elif outcomes:
                    status = outcomes[-1][0]
        except Exception:
            status = "error"
        if not clean:
            status = "tampered"
        emit(out, nonce, status, test_id)
    emit(out, nonce, "DONE", "clean" if clean and intact(watched) else "tampered")


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
