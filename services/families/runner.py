"""The test runner shipped into a workspace, hidden, for each grading run.

Self-contained on purpose: it runs inside the sandbox on the system Python (standard
library only, no pytest) and is copied in fresh from the service's code every time,
so nothing the agent left in the workspace takes part in grading logic.

Usage (argv inside the sandbox): ``python3 .etude-grading/runner.py PATH...`` where
each PATH is a test file or a directory searched for ``test_*.py``. The first line of
stdin is a nonce the grader chose for this run. Tests are module-level callables whose
names start with ``test`` and the test methods of ``unittest.TestCase`` classes.

While tests run, file descriptor 1 points at stderr, so whatever the code under test
prints (even from subprocesses) goes there. The runner alone writes to the original
stdout, exactly once, at the end::

    @@etude-result <nonce> {"passed": 3, "total": 4, "failures": [...], "errors": [...]}

The grader accepts only that line with its own nonce; code under test does not know
the nonce without digging through the runner's frames, so it cannot print a result
by accident or with a simple trick.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import traceback
import unittest
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

RESULT_PREFIX = "@@etude-result"
MAX_FAILURES = 20
MAX_REASON_CHARS = 300


def _reason(error: BaseException) -> str:
    """One line: the exception and, for a bare assert, the failing source line."""
    text = f"{type(error).__name__}: {error}".strip().rstrip(":")
    frames = traceback.extract_tb(error.__traceback__)
    if frames and frames[-1].line and not str(error):
        text = f"{text} at `{frames[-1].line.strip()}`"
    return text.replace("\n", " ")[:MAX_REASON_CHARS]


def _test_files(paths: list[str]) -> Iterator[Path]:
    for name in paths:
        path = Path(name)
        if path.is_dir():
            yield from sorted(path.rglob("test_*.py"))
        else:
            yield path


def _load(path: Path, index: int) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"etude_tests_{index}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _tests(module: ModuleType) -> Iterator[tuple[str, Callable[[], object]]]:
    """Tests defined in the test file itself: the code under test cannot add any by
    defining ``test_*`` names that a test file imports."""
    for name, value in list(vars(module).items()):
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if isinstance(value, type) and issubclass(value, unittest.TestCase):
            for method in unittest.defaultTestLoader.getTestCaseNames(value):
                yield f"{name}.{method}", _unittest_call(value(method))
        elif name.startswith("test") and callable(value):
            yield name, value


def _unittest_call(case: unittest.TestCase) -> Callable[[], object]:
    def call() -> None:
        result = unittest.TestResult()
        case.run(result)
        problems = result.errors + result.failures
        if problems:
            raise AssertionError(problems[0][1].strip().splitlines()[-1])
        if result.skipped:
            raise AssertionError(f"skipped: {result.skipped[0][1]}")

    return call


def main(paths: list[str]) -> dict[str, object]:
    """Runs the tests under `paths`; returns the result object."""
    sys.path.insert(0, os.getcwd())
    passed, total = 0, 0
    failures: list[dict[str, str]] = []
    errors: list[dict[str, str]] = []
    for index, path in enumerate(_test_files(paths)):
        try:
            module = _load(path, index)
        except SyntaxError as error:
            errors.append({"kind": "syntax_error", "where": str(path), "reason": _reason(error)})
            continue
        except BaseException as error:  # the code under test may raise anything, exit too
            errors.append({"kind": "import_error", "where": str(path), "reason": _reason(error)})
            continue
        for name, test in _tests(module):
            total += 1
            try:
                test()
            except BaseException as error:  # SystemExit from the code under test fails it
                if len(failures) < MAX_FAILURES:
                    failures.append({"test": name, "reason": _reason(error)})
            else:
                passed += 1
    return {"passed": passed, "total": total, "failures": failures, "errors": errors}


def _run() -> None:
    # The nonce lives only in this frame, never in a module global the code under test
    # could import.
    nonce = sys.stdin.readline().strip()
    result_fd = os.dup(1)
    os.dup2(2, 1)  # the code under test prints to stderr; stdout carries only the result
    result = main(sys.argv[1:])
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed by the code under test
            stream.flush()
    os.write(result_fd, f"{RESULT_PREFIX} {nonce} {json.dumps(result)}\n".encode())
    # No interpreter shutdown: atexit hooks of the code under test must not print more.
    os._exit(0)


if __name__ == "__main__":
    _run()
