"""``swe_fix``: fix a bug in a Python repository, SWE-Gym / SWE-bench style, with a
black-box agent.

An item is a repository snapshot, a problem statement (an issue as a user wrote it) and
two test lists: ``FAIL_TO_PASS`` (tests the bug breaks, which the fix must make pass) and
``PASS_TO_PASS`` (tests that pass before and must still pass after). The agent (by default
the reference agent, tools ``bash``, ``read_file``, ``write_file``) runs in the rollout's
sandbox with the repository as its working directory (``/workspace``) and ends by replying
without a tool call.

Data:

* ``dataset: SWE-Gym/SWE-Gym`` (the default; loaded with ``datasets.load_dataset``):
  one Docker image per task (``image_template``, by default SWE-Gym's eval images
  ``xingyaoww/sweb.eval.x86_64.<instance_id with "__" -> "_s_">``) with the repository at
  ``/testbed`` and its Python environment at ``/opt/miniconda3/envs/testbed``. The
  sandboxes' root filesystem is read-only, so ``prepare_sandbox`` copies ``/testbed``
  (without ``.git``) into ``/workspace``. Needs ``sandbox_backend: docker``; tests run
  with pytest (test ids are pytest node ids).
* ``dataset: sample``: 3 small repositories written for Lachesis (a semver library, an
  interval-merging library, a text-statistics library; ``data/swe_fix/``), each with one
  seeded bug, an issue, its test lists and the fix. Tests use ``unittest`` and the
  sandbox's stdlib ``python3`` (ids like ``tests.test_version.TestCompare.test_x``).

Rewards (one per assistant turn; the last is the outcome):

* a turn before the last earns ``inspect_reward`` if it looked at code (``read_file``, or
  ``bash`` with ``cat``/``head``/``grep``/``sed -n``/...), ``test_reward`` if it ran tests
  (``bash`` with ``unittest``/``pytest``), ``edit_reward`` if it wrote (``write_file``) a
  non-test ``.py`` file with code that compiles, the call not answered by an error (a
  catalog harness's tools count alike: ``Bash``/``exec_command`` as ``bash``,
  ``read``/``Read`` as ``read_file``, ``write``/``Write`` as ``write_file``, and an
  ``edit``/``Edit`` of a non-test source file as an edit; ``agent: pi``,
  configs/examples/swe-fix-pi.yaml);
* the last turn: 1.0 if every FAIL_TO_PASS and every PASS_TO_PASS test passes, else 0.0.

Grading never trusts the agent's sandbox. ``finish_sandbox`` tars ``/workspace`` (without
``.git``; at most ``max_repo_mb`` compressed) and copies the archive out
(``rollout.extra["repo_tar"]``). Grading then, in a **fresh** sandbox: lays down the
pristine snapshot; overlays the agent's regular files except protected ones (test files:
a ``tests``/``test``/``testing`` directory, ``test_*.py``, ``*_test.py``, ``conftest.py``;
the files ``test_patch`` touches; ``sitecustomize.py``/``usercustomize.py``/``*.pth``;
pytest configuration: ``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``;
anything under a dot-directory or ``__pycache__``), so those stay pristine; applies
``test_patch`` (real records, like SWE-bench); runs the listed tests with a grader script
(:mod:`environments.envs.swe_fix_graders`). The host decides: every listed id ``passed``,
and the ``DONE clean`` line, all with a random nonce. A failure of the grading sandbox
itself (it could not start, the pristine snapshot could not be laid down, ``test_patch``
does not apply to it) raises: the group is dropped, never scored 0.

The grader process never imports the repository. It reads the
nonce into a bytearray (its only copy) and deletes its file, makes itself undumpable (no
process of the sandbox can read its memory, descriptors or environment through /proc, or
ptrace it) and a child subreaper, then forks one child per test module
(``grading_child_per_test``: per test). A child zeroes its copy of the nonce, points its
stdout/stderr at a log, keeps only a pipe holding a token the parent made after the fork
and its report pipe, and only then imports the tests and the repository; it reports one
``token status id`` line per test and exits 0 with ``os._exit`` (no atexit hook runs). The
parent takes a test's status from that line only (right token, right id, in order, exit 0,
before the deadline), kills whatever the child left (the subreaper inherits its orphans),
removes ``__pycache__`` directories, and checks a hash of the test files before and after
every child: a changed, deleted or symlinked test file makes every status ``tampered``.
Inside a child, the checks of the test machinery stay (``TestCase``, ``TestResult``,
``TestSuite``, the loader, ``builtins`` unpatched; every function of a test's class from a
test file).

pytest (real data): the same parent forks one child per test file (or per test), which
runs pytest on it with the machinery checks; ids are looked up in pytest's reports.

Known limits, honestly:

* A test calls the repository's code in its own process, so no separation can decide a
  test's outcome without trusting something that process says. What remains, with
  unittest: code written against the child's report protocol (find the token in its own
  frames, write ``token passed id`` lines to the report pipe, exit 0) reports its own
  module's tests as passed (``tests/test_graders_adversarial.py`` keeps this as a test), and
  inside a child the test machinery checks can be bypassed as before (patching what they do
  not watch, ``sys.settrace``, ``ctypes``); the same holds for pytest's children. What
  no longer works:
  reaching the parent's nonce or results (undumpable, nonce zeroed), forging another
  module's results, atexit hooks, threads and daemons outliving the child, early exits,
  and rewriting test files or bytecode for a later child.
* What is a "test file" is decided by name (and ``test_patch``): a helper a test imports
  from a non-test path (e.g. ``pandas/_testing``) is the agent's to change. Edits to the
  protected files (including ``setup.cfg``/``pyproject.toml``), symlinks, and deletions are
  not carried into grading (deleted files come back from the snapshot).
* pytest (real data): all tests of the files that hold the listed ids are run, and the ids
  looked up in the reports; an id pytest reports under another name counts as failed.
  Real-data grading is not exercised by the test suite (no SWE-Gym images here); the
  pytest grader script is, on the host.
* Real repositories need generous sandbox limits (``sandbox_cpu_time_s``,
  ``sandbox_memory_mb``; ``sandbox_workspace_mb`` for the copy; ``grading_*`` for the
  grading sandbox); the compressed workspace must fit ``max_repo_mb``.
* The reference agent imports ``openai`` from the agent runtime, copied from Lachesis's
  own Python (3.11): in a task image whose ``python3`` (the testbed's, first on PATH) is
  another version, the first rollout fails with that reason. Such images need an agent
  that brings its own interpreter (``agent_command``), or a runtime built for theirs.
* Turn rewards are read from the tool calls (a ``cat`` in every turn earns the inspect
  reward every turn); edits made through ``bash`` (``sed -i``, heredocs) earn no edit
  reward.
"""

from __future__ import annotations

import difflib
import io
import json
import posixpath
import re
import secrets
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from environments.blackbox.env import BlackBoxEnvConfig, BlackBoxEnvMixin
from environments.blackbox.harnesses import HARNESSES
from environments.envs.swe_fix_graders import PYTEST_GRADER, UNITTEST_GRADER
from environments.framework.base import BaseEnv, TurnLevelRewardMixin
from environments.framework.item_order import EpochOrder
from environments.rollout import Rollout
from environments.sandbox import (
    WORKSPACE,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxUsageError,
)
from environments.sandbox.base import workspace_relative

SAMPLE_DIR = Path(__file__).parent / "data" / "swe_fix"
GRADING_DIR = ".lachesis"
"""Where grading keeps its script, nonce and results, inside the grading workspace (a
dot-directory: never overlaid from the agent's files)."""
REPO_ARCHIVE = ".lachesis-repo.tgz"
TEST_DIRS = frozenset({"tests", "test", "testing"})
PROTECTED_NAMES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py",
                             "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})
INSTRUCTIONS = (
    "The repository is your working directory. Fix the issue described above by changing "
    "the repository's source code. Do not modify the existing tests (they are restored "
    "before grading). You can run the tests, e.g. `{test_command}`. When you are done, "
    "reply with a short summary of the fix and no tool call.")

_INSPECT = re.compile(r"\b(cat|head|tail|less|more|nl|grep|rg|find|ls|sed\s+-n)\b")
_RUN_TESTS = re.compile(r"\b(unittest|pytest)\b|\bpython3?\s+\S*test\S*\.py\b")
# The tools of the reference agent and of the catalog harnesses (docs/harnesses.md), for
# the turn rewards: a shell command (``command``, Codex's ``cmd``), a file read, a whole
# file written (``content``), an edit (old/new strings) of a file.
SHELL_TOOLS = {"bash", "shell", *(h.shell_tool[0] for h in HARNESSES.values())}
READ_TOOLS = {"read_file", "read", "Read"}
WRITE_TOOLS = {"write_file", "write", "Write"}
EDIT_TOOLS = {"edit", "Edit", "MultiEdit"}


# -- paths ---------------------------------------------------------------------------------
def is_test_path(path: str) -> bool:
    """A test file by its name: under a tests/test/testing directory, ``test_*.py``,
    ``*_test.py`` or ``conftest.py``."""
    parts = path.split("/")
    name = parts[-1]
    return (any(p in TEST_DIRS for p in parts[:-1]) or name.startswith("test_")
            or name.endswith("_test.py") or name == "conftest.py")


def is_protected(path: str, test_files: frozenset[str] | set[str] = frozenset()) -> bool:
    """A file grading always takes from the pristine snapshot, never from the agent."""
    parts = path.split("/")
    return (is_test_path(path) or path in test_files or parts[-1] in PROTECTED_NAMES
            or parts[-1].endswith(".pth")
            or any(p.startswith(".") or p == "__pycache__" for p in parts))


def _relative(path: Any) -> str | None:
    try:
        return workspace_relative(str(path))
    except (SandboxUsageError, ValueError):
        return None


def is_source_path(path: Any, test_files: frozenset[str] | set[str] = frozenset()) -> bool:
    """A non-test ``.py`` file of the repository (what an edit reward is for)."""
    relative = _relative(path)
    return (relative is not None and relative.endswith(".py")
            and not is_protected(relative, test_files))


def patch_paths(patch: str) -> list[str]:
    """The files a unified diff (git format) touches."""
    paths = set()
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            match = re.match(r'diff --git "?a/(.+?)"? "?b/(.+?)"?$', line)
            if match:
                paths.update(match.groups())
        elif line.startswith(("--- a/", "+++ b/")):
            paths.add(line[6:].split("\t")[0].strip())
    return sorted(paths)


def unified_patch(before: dict[str, str], after: dict[str, str]) -> str:
    """A git-style patch from ``before`` to ``after`` (path -> text)."""
    chunks = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        chunks.append(f"diff --git a/{path} b/{path}\n")
        chunks.extend(difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
            f"a/{path}" if old is not None else "/dev/null",
            f"b/{path}" if new is not None else "/dev/null"))
    return "".join(chunks)


# -- data ----------------------------------------------------------------------------------
def _test_list(value: Any, field_name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field_name} must be a list of test ids, got {value!r:.200}")
    for test_id in value:
        if not test_id or any(c in test_id for c in "\t\n\r"):
            raise ValueError(f"{field_name}: bad test id {test_id!r}")
    return list(value)


def task_from_record(row: dict[str, Any]) -> dict[str, Any]:
    """An item from a SWE-Gym / SWE-bench record (``FAIL_TO_PASS`` / ``PASS_TO_PASS``
    may be JSON strings, as on the hub)."""
    test_patch = row.get("test_patch") or ""
    return {
        "id": row["instance_id"], "instance_id": row["instance_id"],
        "repo": row.get("repo", ""), "base_commit": row.get("base_commit", ""),
        "problem_statement": row["problem_statement"],
        "fail_to_pass": _test_list(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS"),
        "pass_to_pass": _test_list(row.get("PASS_TO_PASS"), "PASS_TO_PASS"),
        "patch": row.get("patch") or "", "test_patch": test_patch,
        "test_files": patch_paths(test_patch),
        "runner": "pytest", "files": None, "fixed_files": None,
    }


def _read_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text()
            for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def load_sample() -> list[dict[str, Any]]:
    """The sample tasks: ``data/swe_fix/<task>/`` holds ``task.json`` (a SWE-bench-shaped
    record), ``repo/`` (the buggy snapshot) and ``fix/`` (the fixed files)."""
    tasks = []
    for task_dir in sorted(p for p in SAMPLE_DIR.iterdir() if (p / "task.json").is_file()):
        record = json.loads((task_dir / "task.json").read_text())
        files = _read_tree(task_dir / "repo")
        fixed = {**files, **_read_tree(task_dir / "fix")}
        item = task_from_record({**record, "patch": unified_patch(files, fixed)})
        item.update(runner="unittest", files=files, fixed_files=fixed,
                    test_files=sorted(p for p in files if is_test_path(p)))
        tasks.append(item)
    return tasks


def load_swe_gym(name: str, split: str) -> list[dict[str, Any]]:
    try:
        from datasets import load_dataset
    except ImportError:
        raise RuntimeError("swe_fix with a hub dataset needs `pip install datasets` "
                           "(or use dataset: sample)") from None
    return [task_from_record(row) for row in load_dataset(name, split=split)]


# -- archives ------------------------------------------------------------------------------
def make_tar(files: dict[str, bytes | str], modes: dict[str, int] | None = None) -> bytes:
    buffer = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path, data in sorted(files.items()):
            data = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(path)
            info.size, info.mtime = len(data), now
            info.mode = (modes or {}).get(path, 0o644)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class RepoArchiveError(ValueError):
    """The agent's repository archive cannot be used (the agent's doing: scored 0)."""


def read_repo_tar(data: bytes, max_unpacked_bytes: int) -> dict[str, tuple[bytes, int]]:
    """The regular files of a (gzipped) tar, in memory: path -> (content, mode). Members
    are vetted with tarfile's ``data`` filter (no absolute paths, no ``..``, no links, no
    devices); anything else is skipped; nothing is written to the host's disk."""
    files: dict[str, tuple[bytes, int]] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for member in tar:
                if not member.isreg():
                    continue
                try:
                    if hasattr(tarfile, "data_filter"):
                        member = tarfile.data_filter(member, "/nonexistent-destination")
                except tarfile.FilterError:
                    continue
                name = posixpath.normpath(member.name)
                if name.startswith(("/", "../")) or name in (".", ".."):
                    continue
                total += member.size
                if total > max_unpacked_bytes:
                    raise RepoArchiveError(f"the repository unpacks to more than "
                                           f"{max_unpacked_bytes >> 20} MB")
                handle = tar.extractfile(member)
                files[name] = (handle.read() if handle else b"", member.mode & 0o777)
    except (tarfile.TarError, EOFError, OSError, ValueError) as error:
        if isinstance(error, RepoArchiveError):
            raise
        raise RepoArchiveError(f"unreadable repository archive: {error}") from error
    return files


# -- the env -------------------------------------------------------------------------------
class SweFixConfig(BlackBoxEnvConfig):
    dataset: str = "SWE-Gym/SWE-Gym"
    """A SWE-Gym / SWE-bench-shaped hub dataset (``datasets.load_dataset``; needs
    ``sandbox_backend: docker`` and its per-task images) or ``sample``: 3 small
    repositories that ship with Lachesis."""
    split: str = "train"
    shuffle: bool = True
    image_template: str = "xingyaoww/sweb.eval.x86_64.{docker_id}"
    """docker image of a hub task: ``{instance_id}``, or ``{docker_id}`` (the instance id,
    lowercase, ``__`` replaced by ``_s_``, as SWE-Gym's eval images are named)."""
    testbed_dir: str = "/testbed"
    """Where a task image holds the repository (copied into /workspace)."""
    testbed_bin: str = "/opt/miniconda3/envs/testbed/bin"
    """Put first on PATH for hub tasks (the image's Python environment)."""
    sandbox_workspace_mb: int = Field(default=1024, ge=16)
    """Size of the workspace (docker: the tmpfs; bwrap: the quota)."""
    max_repo_mb: int = Field(default=64, ge=1)
    """The agent's workspace, compressed, must fit in this to be graded (else 0)."""
    max_repo_unpacked_mb: int = Field(default=1024, ge=1)
    inspect_reward: float = 0.1
    test_reward: float = 0.2
    edit_reward: float = 0.3
    grading_timeout_s: float = Field(default=120.0, gt=0)
    """Wall-clock limit of the test run in the grading sandbox (and its CPU seconds)."""
    grading_memory_mb: int = Field(default=2048, ge=64)
    grading_child_per_test: bool = False
    """unittest grading: one child process per test instead of one per test module
    (tests then cannot affect each other; ~20 ms more per test)."""

    def sandbox_config(self) -> SandboxConfig:
        config = super().sandbox_config()
        update: dict[str, Any] = {"workspace_mb": self.sandbox_workspace_mb}
        if self.dataset != "sample":
            update["env"] = {**config.env, "PATH": f"{self.testbed_bin}:/usr/local/bin:"
                                                   "/usr/bin:/bin:/usr/sbin:/sbin"}
        return config.model_copy(update=update)


@dataclass
class Grading:
    resolved: bool
    statuses: dict[str, str] = field(default_factory=dict)
    """Status of each listed test: passed, failed, error, skipped, not_found, tampered,
    missing (no result line)."""
    clean: bool = False
    """The grader finished and the test files stayed as they were (a child that found the
    test machinery patched reports its tests ``tampered``)."""
    edited_tests: bool = False
    reason: str = ""


class SweFixEnv(BlackBoxEnvMixin, TurnLevelRewardMixin, BaseEnv):
    name = "swe_fix"
    config_class = SweFixConfig
    config: SweFixConfig

    def __init__(self, config: SweFixConfig | None = None):
        super().__init__(config)
        self.tasks: list[dict[str, Any]] | None = None
        self.order = EpochOrder(self.rng, self.config.shuffle)

    # -- data ----------------------------------------------------------------------------
    @property
    def sample(self) -> bool:
        return self.config.dataset == "sample"

    async def setup(self) -> None:
        if self.tasks is None:
            c = self.config
            if not self.sample and c.sandbox_backend != "docker":
                raise ValueError(f"swe_fix with {c.dataset} needs sandbox_backend: docker "
                                 "(each task's repository is in its own image)")
            self.tasks = load_sample() if self.sample else load_swe_gym(c.dataset, c.split)

    async def get_next_item(self) -> dict[str, Any]:
        if self.tasks is None:
            await self.setup()
        return self.order.next(self.tasks)

    async def eval_items(self) -> list[dict[str, Any]]:
        await self.setup()
        return self.tasks[:self.config.eval_items]

    # -- black-box hooks -----------------------------------------------------------------
    def agent_task(self, item: dict[str, Any]) -> str:
        command = ("python3 -m unittest" if item["runner"] == "unittest"
                   else "python -m pytest -q <test file>")
        return (f"{item['problem_statement'].strip()}\n\n"
                + INSTRUCTIONS.format(test_command=command))

    def sandbox_image(self, item: dict[str, Any]) -> str | None:
        if item.get("files") is not None:  # a sample task: the config's image
            return self.config.sandbox_image
        instance_id = item["instance_id"]
        return self.config.image_template.format(
            instance_id=instance_id, docker_id=instance_id.replace("__", "_s_").lower())

    async def _lay_down_snapshot(self, item: dict[str, Any], sandbox: Sandbox) -> None:
        """The pristine repository in ``/workspace``; a failure raises SandboxError."""
        if item.get("files") is not None:
            await self._extract(sandbox, make_tar(item["files"]))
            return
        source = self.config.testbed_dir
        result = await sandbox.exec(
            f"(tar -C '{source}' --exclude=./.git -cf - . || echo LACHESIS-COPY-FAILED >&2)"
            f" | tar -C {WORKSPACE} --no-same-owner -xf -",
            timeout_s=max(self.config.sandbox_timeout_s, self.config.grading_timeout_s))
        if not result.ok or "LACHESIS-COPY-FAILED" in result.stderr:
            raise SandboxError(f"item {item['id']}: copying {source} into the workspace "
                               f"failed: {result.describe(500)}")

    async def _extract(self, sandbox: Sandbox, archive: bytes) -> None:
        await sandbox.write_file(f"{GRADING_DIR}/in.tar", archive)
        result = await sandbox.exec(
            f"tar --no-same-owner -xf {GRADING_DIR}/in.tar && rm -f {GRADING_DIR}/in.tar",
            timeout_s=max(self.config.sandbox_timeout_s, 60.0))
        if not result.ok:
            raise SandboxError(f"extracting files in the sandbox failed: "
                               f"{result.describe(500)}")

    async def prepare_sandbox(self, item: dict[str, Any], sandbox: Sandbox) -> None:
        await self._lay_down_snapshot(item, sandbox)
        result = await sandbox.exec(f"rm -rf {GRADING_DIR}")
        if not result.ok:
            raise SandboxError(f"cleaning up the workspace failed: {result.describe(500)}")

    async def finish_sandbox(self, item: dict[str, Any], sandbox: Sandbox,
                             rollout: Rollout) -> None:
        """Copy the agent's repository out (a gzipped tar, without ``.git``)."""
        rollout.extra["repo_tar"] = None
        rollout.extra["repo_error"] = None
        result = await sandbox.exec(
            f"rm -rf {REPO_ARCHIVE} && tar --exclude=./.git --exclude=./{REPO_ARCHIVE} "
            f"--exclude=__pycache__ -czf {REPO_ARCHIVE} .",
            timeout_s=max(self.config.sandbox_timeout_s, 60.0))
        if result.exit_code not in (0, 1):  # 1: "file changed as we read it"
            rollout.extra["repo_error"] = f"archiving the workspace failed: {result.describe(300)}"
            return
        try:
            rollout.extra["repo_tar"] = await sandbox.read_file(
                REPO_ARCHIVE, max_bytes=self.config.max_repo_mb << 20)
        except (SandboxUsageError, FileNotFoundError) as error:
            rollout.extra["repo_error"] = f"the workspace archive cannot be read: {error}"

    # -- grading -------------------------------------------------------------------------
    async def _grading_sandbox(self, item: dict[str, Any]) -> Sandbox:
        c = self.config
        return await self.new_sandbox(
            image=self.sandbox_image(item), network=False, timeout_s=c.grading_timeout_s,
            cpu_time_s=max(c.sandbox_cpu_time_s, int(c.grading_timeout_s) + 1),
            memory_mb=max(c.sandbox_memory_mb, c.grading_memory_mb))

    async def grade(self, item: dict[str, Any], repo_tar: bytes | None) -> Grading:
        """Run the listed tests on the agent's repository in a fresh sandbox (see the
        module docstring). Raises SandboxError when grading itself fails."""
        if repo_tar is None:
            return Grading(False, reason="no repository")
        try:
            agent_files = read_repo_tar(repo_tar, self.config.max_repo_unpacked_mb << 20)
        except RepoArchiveError as error:
            return Grading(False, reason=str(error))
        test_files = set(item["test_files"])
        overlay = {p: v for p, v in agent_files.items() if not is_protected(p, test_files)}
        edited_tests = False
        if item.get("files") is not None:
            pristine_tests = {p: t for p, t in item["files"].items() if is_test_path(p)}
            edited_tests = any(p not in agent_files or agent_files[p][0] != t.encode()
                               for p, t in pristine_tests.items())
        async with await self._grading_sandbox(item) as box:
            try:
                return await self._grade_in(box, item, agent_files, overlay, edited_tests)
            except SandboxError:
                self.sandbox_stats.sandbox_failures += 1
                raise

    async def _grade_in(self, box: Sandbox, item: dict[str, Any],
                        agent_files: dict[str, tuple[bytes, int]],
                        overlay: dict[str, tuple[bytes, int]], edited_tests: bool) -> Grading:
        c = self.config
        await self._lay_down_snapshot(item, box)
        if item.get("files") is None:  # real: the test_patch files as they were
            for path in item["test_files"]:
                try:
                    before = await box.read_file(path)
                except (FileNotFoundError, SandboxUsageError):
                    continue  # a file test_patch creates
                if path not in agent_files or agent_files[path][0] != before:
                    edited_tests = True
        if overlay:
            await self._extract(box, make_tar(
                {p: v[0] for p, v in overlay.items()},
                {p: (v[1] & 0o755) | 0o644 for p, v in overlay.items()}))
        if item["test_patch"]:
            await box.write_file(f"{GRADING_DIR}/test.patch", item["test_patch"])
            result = await box.exec(f"git apply --whitespace=nowarn {GRADING_DIR}/test.patch",
                                    timeout_s=60.0)
            if not result.ok:
                raise SandboxError(f"item {item['id']}: test_patch does not apply to the "
                                   f"pristine snapshot: {result.describe(500)}")
        wanted = item["fail_to_pass"] + item["pass_to_pass"]
        spec: dict[str, Any] = {
            "tests": wanted, "timeout_s": max(1.0, c.grading_timeout_s - 2),
            "per_test": c.grading_child_per_test,
            "protect": (sorted(p for p in item["files"] if is_test_path(p))
                        if item.get("files") is not None else item["test_files"])}
        if item["runner"] == "pytest":
            spec["paths"] = ["", "src"]
            grader, python = PYTEST_GRADER, f"{c.testbed_bin}/python"
        else:
            grader, python = UNITTEST_GRADER, "python3"
        nonce = secrets.token_hex(16)
        await box.write_file(f"{GRADING_DIR}/grader.py", grader)
        await box.write_file(f"{GRADING_DIR}/spec.json", json.dumps(spec))
        await box.write_file(f"{GRADING_DIR}/nonce", nonce)
        result = await box.exec(
            f"{python} -I {WORKSPACE}/{GRADING_DIR}/grader.py >{GRADING_DIR}/log 2>&1",
            timeout_s=c.grading_timeout_s)
        self.sandbox_stats.grading_timeouts += result.timed_out
        try:
            text = (await box.read_file(f"{GRADING_DIR}/results", max_bytes=16 << 20)
                    ).decode("utf-8", errors="replace")
        except (FileNotFoundError, SandboxUsageError):
            text = ""
        statuses, clean = parse_results(text, nonce, wanted)
        resolved = clean and all(s == "passed" for s in statuses.values())
        reason = ("" if resolved else "timed out" if result.timed_out
                  else "tests failed" if clean else "grader did not finish cleanly")
        return Grading(resolved, statuses, clean, edited_tests, reason)

    # -- rewards -------------------------------------------------------------------------
    def _turn_actions(self, item: dict[str, Any], turn) -> tuple[bool, bool, bool]:
        """Whether the turn inspected code, ran tests, wrote a non-test source file: by the
        reference agent's tools or a catalog harness's (``SHELL_TOOLS``, ``READ_TOOLS``,
        ``WRITE_TOOLS``, ``EDIT_TOOLS``)."""
        inspected = tested = edited = False
        test_files = set(item["test_files"])
        for call, content in zip(turn.tool_calls, turn.tool_results):
            if str(content).lstrip().lower().startswith("error"):
                continue
            args = call.arguments if isinstance(call.arguments, dict) else {}
            command = args.get("command", args.get("cmd", "")) if call.name in SHELL_TOOLS \
                else ""
            command = " ".join(map(str, command)) if isinstance(command, list) else str(command)
            path = next((args[k] for k in ("path", "file_path", "filePath") if k in args), None)
            if call.name in READ_TOOLS or _INSPECT.search(command):
                inspected = True
            if _RUN_TESTS.search(command):
                tested = True
            if call.name in WRITE_TOOLS and is_source_path(path, test_files):
                try:
                    compile(str(args.get("content", "")), "<write_file>", "exec")
                    edited = True
                except (SyntaxError, ValueError):
                    pass
            elif call.name in EDIT_TOOLS and is_source_path(path, test_files):
                edited = True  # (an edit's result is checked by the grading, not here)
        return inspected, tested, edited

    def turn_score(self, item: dict[str, Any], turn) -> float:
        c = self.config
        inspected, tested, edited = self._turn_actions(item, turn)
        return c.inspect_reward * inspected + c.test_reward * tested + c.edit_reward * edited

    async def compute_turn_rewards(self, item: dict[str, Any],
                                   rollout: Rollout) -> list[float]:
        # A SandboxError here drops the group (counted): a grading that failed is not a 0.
        grading = await self.grade(item, rollout.extra.get("repo_tar"))
        rollout.extra["grading"] = asdict(grading)
        rewards = [self.turn_score(item, turn) for turn in rollout.turns[:-1]]
        return rewards + [1.0 if grading.resolved else 0.0]

    def rollout_metrics(self, item: dict[str, Any], rollout: Rollout,
                        scores: float | list[float]) -> dict[str, float]:
        """``resolved`` (outcome 1), ``edited_tests`` (an existing test file was changed
        or deleted in the agent's repository), ``ran_tests`` / ``edited_source`` (some
        turn ran tests / wrote a non-test .py file), ``fail_to_pass_rate`` (share of the
        FAIL_TO_PASS tests that passed)."""
        grading = rollout.extra.get("grading") or {}
        actions = [self._turn_actions(item, t) for t in rollout.turns]
        statuses = grading.get("statuses", {})
        f2p = item["fail_to_pass"]
        return {
            "resolved": float(bool(grading.get("resolved"))),
            "edited_tests": float(bool(grading.get("edited_tests"))),
            "ran_tests": float(any(a[1] for a in actions)),
            "edited_source": float(any(a[2] for a in actions)),
            "fail_to_pass_rate": (sum(statuses.get(t) == "passed" for t in f2p) / len(f2p)
                                  if f2p else 0.0),
        }


def parse_results(text: str, nonce: str, wanted: list[str]) -> tuple[dict[str, str], bool]:
    """Statuses of the ``wanted`` tests from the grader's result lines (only lines with
    the nonce count; ``missing`` when a test has none) and whether the grader finished
    clean."""
    found: dict[str, str] = {}
    clean = False
    for line in text.splitlines():
        parts = line.split("\t", 2)
        if len(parts) != 3 or parts[0] != nonce:
            continue
        _, status, test_id = parts
        if status == "DONE":
            clean = test_id == "clean"
        else:
            found[test_id] = status
    return {t: found.get(t, "missing") for t in wanted}, clean
