"""Grading: run a task's hidden tests in the sandbox and turn the outcome into a score.

``grade`` copies the grading spec's hidden files and the runner
(``services/families/runner.py``, always the service's own copy) into the
workspace, runs the grading command in the sandbox under the spec's timeout, and
removes them again (restoring any workspace file they displaced), so the agent never
sees the hidden tests between runs.

How a result is read:

* A line ``@@etude-result <nonce> {json}`` on stdout carrying this run's nonce (sent as
  the first line of stdin) gives passed/total; the runner prints it, and any command
  that reads the nonce from stdin may print it too.
* Without one, a command that calls the runner failed to finish ("no_result", or
  "crash" when a signal or rlimit ended it); any other command is scored by its exit
  code as a single test.

Scores follow the spec's ``RewardMode``: ALL_PASS (also the default) gives 1.0 only
when every test passed, PASS_FRACTION gives passed / total. Anything of the code's that
stops grading early scores 0 with a ``failure_reason``: "timeout", "syntax_error",
"import_error", "crash", "no_result", "forged_result", "no_tests".

What is not the code's is never scored (``services.envs.faults``): a sandbox that could
not start or was killed from outside raises ``InfraFault``, and a timeout is re-run once
in a fresh sandbox with CPU time as the judge before it counts as the code's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.api.v1 import common_pb2
from services.envs import faults, metrics
from services.envs.sandbox import ExecOutcome
from services.envs.workspace import Workspaces
from services.families import GRADING_DIR, RUNNER_PATH, runner
from services.families.runner import RESULT_PREFIX

log = logging.getLogger(__name__)

RUNNER_SOURCE = Path(runner.__file__).read_bytes()
DEFAULT_TIMEOUT_S = 60.0
# Grading writes no bytecode into the workspace: it would outlive the run.
GRADING_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


@dataclass
class _Placed:
    """What placing the hidden files changed, so it can be undone."""

    created_dirs: list[Path]
    written: list[Path]
    # path -> the agent's file there: (content, mode), or (link target, -1) for a symlink
    displaced: dict[Path, tuple[bytes, int]]


def _set_aside(path: Path, placed: _Placed) -> None:
    """Removes the agent's entry at `path`, remembering a file or symlink to restore.

    A directory where a hidden file must go is removed for good (it cannot be both).
    """
    if path.is_symlink():
        placed.displaced.setdefault(path, (os.readlink(path).encode(), -1))
    elif path.is_file():
        placed.displaced.setdefault(path, (path.read_bytes(), stat.S_IMODE(path.stat().st_mode)))
    _remove(path)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for directory, _, _ in os.walk(path):
        os.chmod(directory, 0o755)  # a forked tree's directories may be read-only
    shutil.rmtree(path)


def _place(root: Path, files: Sequence[common_pb2.WorkspaceFile], placed: _Placed) -> None:
    """Writes files under `root`, replacing whatever the agent put on their paths.

    Every path component is checked with lstat: a symlink or file where a directory
    must be is removed, so no write can be redirected outside the workspace.
    """
    for file in files:
        parts = Path(file.path).parts
        if not parts or file.path.startswith("/") or ".." in parts:
            raise ValueError(f"hidden file {file.path!r} must be a relative path without '..'")
        directory = root
        for part in parts[:-1]:
            directory = directory / part
            if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
                _set_aside(directory, placed)
            if not directory.exists():
                directory.mkdir(mode=0o755)  # owned by the service: the sandbox cannot write
                placed.created_dirs.append(directory)
        target = directory / parts[-1]
        if target in placed.written:
            target.unlink()  # the same path twice in one spec: the last one wins
        elif target.is_symlink() or target.exists():
            _set_aside(target, placed)
        target.write_bytes(file.content)
        target.chmod(0o555 if file.executable else 0o444)
        placed.written.append(target)


def _restore(placed: _Placed, uid: int | None) -> None:
    for path in placed.written:
        if path.is_symlink() or path.exists():
            _remove(path)
    for directory in reversed(placed.created_dirs):
        if directory.exists():
            _remove(directory)
    for path, (content, mode) in placed.displaced.items():
        if mode < 0:
            os.symlink(content.decode(), path)
        else:
            path.write_bytes(content)
            path.chmod(mode)
        if uid is not None:
            os.lchown(path, uid, uid)


def _parse(raw: bytes) -> dict[str, Any] | None:
    """A result object of the runner's shape, or None."""
    try:
        result = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(result, dict):
        return None
    passed, total = result.get("passed"), result.get("total")
    if not (isinstance(passed, int) and isinstance(total, int) and 0 <= passed <= total):
        return None
    for key in ("failures", "errors"):
        entries = result.setdefault(key, [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            return None
    return result


def _result_line(stdout: bytes, nonce: str) -> tuple[dict[str, Any] | None, bool, bytes]:
    """(the result, whether a forged, duplicate or malformed line was seen, stdout
    without the result line)."""
    marker = f"{RESULT_PREFIX} {nonce} ".encode()
    results, kept, forged = [], [], False
    for line in stdout.splitlines(keepends=True):
        if line.startswith(marker):
            results.append(line[len(marker) :])
        else:
            forged |= line.startswith(RESULT_PREFIX.encode())
            kept.append(line)
    if len(results) != 1:
        return None, forged or len(results) > 1, b"".join(kept)
    result = _parse(results[0])
    return result, forged or result is None, b"".join(kept)


def _report(result: dict[str, Any]) -> bytes:
    """What a person or the agent reads: counts, then each failure."""
    passed, total = result["passed"], result["total"]
    lines = [f"{passed} passed, {total - passed} failed"]
    lines += [f"ERROR {e.get('where', '')}: {e.get('reason', '')}" for e in result["errors"]]
    lines += [f"FAILED {f.get('test', '')}: {f.get('reason', '')}" for f in result["failures"]]
    return ("\n".join(lines) + "\n").encode()


def _exec_result(outcome: ExecOutcome, stdout: bytes) -> common_pb2.ExecResult:
    return common_pb2.ExecResult(
        exit_code=outcome.exit_code,
        stdout=stdout,
        stderr=outcome.stderr,
        timed_out=outcome.timed_out,
        killed_by=outcome.killed_by,
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        wall_s=outcome.wall_s,
    )


def score_of(num_passed: int, num_tests: int, mode: common_pb2.RewardMode.ValueType) -> float:
    """The task reward of `num_passed` of `num_tests` under `mode` (0 without tests)."""
    if num_tests <= 0:
        return 0.0
    if mode == common_pb2.REWARD_MODE_PASS_FRACTION:
        return num_passed / num_tests
    return 1.0 if num_passed == num_tests else 0.0


def _interpret(
    outcome: ExecOutcome, grading: common_pb2.GradingSpec, nonce: str
) -> common_pb2.GradeResult:
    result, forged, stdout = _result_line(outcome.stdout, nonce)
    uses_runner = any(RUNNER_PATH in arg for arg in grading.command)
    failure, num_passed, num_tests = "", 0, 0
    if outcome.timed_out:
        failure = "timeout"
    elif forged:
        failure = "forged_result"
    elif result is not None:
        num_passed, num_tests = result["passed"], result["total"]
        stdout = _report(result) + stdout
        if result["errors"]:
            failure = str(result["errors"][0].get("kind", "import_error"))
        elif num_tests == 0:
            failure = "no_tests"
    elif outcome.killed_by:
        failure = "crash"
    elif uses_runner:
        failure = "no_result"
    else:
        num_passed, num_tests = int(outcome.exit_code == 0), 1
    score = 0.0 if failure else score_of(num_passed, num_tests, grading.reward_mode)
    return common_pb2.GradeResult(
        num_tests=num_tests,
        num_passed=0 if failure else num_passed,
        score=score,
        all_passed=not failure and num_tests > 0 and num_passed == num_tests,
        failure_reason=failure,
        exec=_exec_result(outcome, stdout),
    )


def _run_judged(
    workspaces: Workspaces, root: Path, command: list[str], nonce: str, limit_s: float
) -> ExecOutcome:
    """Runs the grading command; a timeout with CPU to spare is re-run once in a fresh
    sandbox (new namespaces and /tmp, the same workspace) under a CPU-time limit of
    `limit_s`, capped by the sandbox's own (``faults`` says how it is judged). Raises
    InfraFault when the infrastructure ended a run."""
    sandbox = workspaces.sandbox
    stdin = f"{nonce}\n".encode()
    outcome = sandbox.run(root, command, stdin=stdin, env=GRADING_ENV, wall_s=limit_s)
    # The sandbox's own wall clock may be shorter than the spec's limit.
    limit_s = min(limit_s, sandbox.config.wall_s)
    try:
        first = faults.judge_first(outcome, limit_s)
    except faults.InfraFault as fault:
        if outcome.timed_out:  # it timed out before the host had set the sandbox up
            metrics.GRADING_TIMEOUTS.labels(fault.kind).inc()
        raise
    if first.verdict is faults.Verdict.CODE_LOOP:
        metrics.GRADING_TIMEOUTS.labels("code_loop").inc()
    if first.verdict is not faults.Verdict.RERUN:
        return outcome
    cpu_limit_s = max(1, min(math.ceil(limit_s), sandbox.config.cpu_s))
    try:
        outcome = sandbox.run(root, command, stdin=stdin, env=GRADING_ENV, cpu_s=cpu_limit_s)
        judged = faults.judge_rerun(outcome, cpu_limit_s)
    except faults.InfraFault as fault:
        metrics.GRADING_TIMEOUTS.labels(f"rerun_{fault.kind}").inc()
        raise
    metrics.GRADING_TIMEOUTS.labels(f"rerun_{judged.verdict.value}").inc()
    log.info(
        "grading timed out with CPU to spare (%s); re-run: %s (%s)",
        first.describe(),
        judged.verdict.value,
        judged.describe(),
    )
    if judged.verdict is faults.Verdict.CODE_LOOP:
        # Its CPU time reached the limit: scored as the timeout it is, however it ended.
        outcome.timed_out, outcome.killed_by = True, "rlimit_cpu"
    return outcome


def grade(
    workspaces: Workspaces,
    workspace_id: str,
    grading: common_pb2.GradingSpec,
    *,
    timeout_s: float | None = None,
) -> common_pb2.GradeResult:
    """Runs `grading` in the workspace's sandbox and scores it; the workspace is left as
    it was (hidden files removed, displaced agent files restored).

    `timeout_s` overrides the spec's timeout (which defaults to DEFAULT_TIMEOUT_S); the
    sandbox's own wall-clock limit caps both. Never raises for what the code under test
    does; raises ``faults.InfraFault`` for what the infrastructure did (the sandbox did
    not start, was killed from outside, or starved the command of CPU twice), and
    ValueError for an empty command or a hidden path outside the workspace.
    """
    if not grading.command or not grading.command[0]:
        raise ValueError("grading.command must name a program")
    if workspace_id.startswith("snap-"):
        raise ValueError(f"{workspace_id} is a snapshot (read-only): grade a fork of it")
    root = workspaces.path(workspace_id)
    runner = common_pb2.WorkspaceFile(path=RUNNER_PATH, content=RUNNER_SOURCE)
    placed = _Placed([], [], {})
    nonce = secrets.token_hex(16)
    try:
        # The grading directory is reserved: whatever the agent put there goes first.
        if (root / GRADING_DIR).exists() or (root / GRADING_DIR).is_symlink():
            _remove(root / GRADING_DIR)
        _place(root, [*grading.hidden_files, runner], placed)
        outcome = _run_judged(
            workspaces,
            root,
            list(grading.command),
            nonce,
            timeout_s or grading.timeout_s or DEFAULT_TIMEOUT_S,
        )
    finally:
        _restore(placed, workspaces.sandbox.run_uid())
    return _interpret(outcome, grading, nonce)


def grade_files(
    workspaces: Workspaces,
    task: common_pb2.Task,
    files: Sequence[common_pb2.WorkspaceFile],
    *,
    timeout_s: float | None = None,
) -> common_pb2.GradeResult:
    """Grades `files` written over a fresh workspace of `task` (then deleted): how a
    completion is scored outside an agent rollout (``etude envs grade``, evals, tests)."""
    workspace = workspaces.create(task)
    try:
        for file in files:
            workspaces.write_file(workspace.workspace_id, file.path, file.content.decode())
        return grade(workspaces, workspace.workspace_id, task.grading, timeout_s=timeout_s)
    finally:
        workspaces.delete(workspace.workspace_id)
