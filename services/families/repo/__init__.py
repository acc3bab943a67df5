"""The repo family: real repositories, an instruction and a test command.

Tasks are listed in a TOML file, one ``[[tasks]]`` table each::

    [[tasks]]
    id = "tinylib/fix-add"              # the task id (letters, digits, ._:/-)
    path = "tinylib"                    # a directory or git checkout, relative to this file
    instruction = "Make add() add."
    test_command = ["python3", "-m", "unittest", "-q"]
    hidden_tests = "tinylib-hidden"     # optional: files copied in only for grading
    timeout_s = 60
    reward_mode = "all_pass"            # or "pass_fraction"
    split = "train"

The workspace is the directory's files (for a git checkout, the files git tracks, as
they are on disk; symlinks are left out). Grading runs the test command in the sandbox
and scores by its exit code, or by test counts when it reports them in the grader's
format: a command ``python3 .etude-grading/runner.py tests/`` (the shipped runner:
``test_*`` functions and unittest cases, no pytest needed) always does.
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from services.api.v1 import common_pb2
from services.config import IDENTIFIER, MIB, StrictModel
from services.families import TaskFamily, files_from_json

MAX_WORKSPACE_BYTES = 16 * MIB
_SKIPPED_DIRS = {".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".venv"}
_REWARD_MODES = {
    "all_pass": common_pb2.REWARD_MODE_ALL_PASS,
    "pass_fraction": common_pb2.REWARD_MODE_PASS_FRACTION,
}


class RepoTaskSpec(StrictModel):
    """One repository task of a repo task file."""

    id: str = Field(
        pattern=rf"^{IDENTIFIER}$",
        description="Task id: letters, digits and ._:/-, at most 256 characters.",
    )
    path: Path = Field(description="Directory or git checkout (relative to the task file).")
    instruction: str = Field(min_length=1, description="What the agent is asked to do.")
    test_command: list[str] = Field(min_length=1, description="argv of the grading command.")
    hidden_tests: Path | None = Field(
        None, description="Directory of files copied into the workspace only for grading."
    )
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Wall clock of the test command.")
    reward_mode: Literal["all_pass", "pass_fraction"] = Field(
        "all_pass", description="all_pass: 1 only when everything passes; pass_fraction."
    )
    split: str = Field("train", min_length=1, description="The split the task belongs to.")
    difficulty: float = Field(0.5, ge=0, le=1, description="Family-defined difficulty.")


def _listed(root: Path) -> Iterator[Path]:
    """Relative paths of the regular files of a directory (git's tracked files in a repo)."""
    if (root / ".git").exists():
        listing = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"],
            capture_output=True,
            check=True,
            timeout=60,
        )
        for name in listing.stdout.decode().split("\0"):
            if name and (root / name).is_file() and not (root / name).is_symlink():
                yield Path(name)
        return
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                yield path.relative_to(root)


def read_tree(root: Path, what: str) -> list[common_pb2.WorkspaceFile]:
    """The files under `root` as workspace files; ValueError naming `what` when too big."""
    if not root.is_dir():
        raise ValueError(f"{what}: {root} is not a directory")
    files, total = [], 0
    for relative in _listed(root):
        path = root / relative
        total += path.stat().st_size
        if total > MAX_WORKSPACE_BYTES:
            raise ValueError(
                f"{what}: {root} holds more than {MAX_WORKSPACE_BYTES // MIB} MiB of files; "
                "large workspaces travel as archives in the object store"
            )
        files.append(
            common_pb2.WorkspaceFile(
                path=relative.as_posix(),
                content=path.read_bytes(),
                executable=bool(path.stat().st_mode & 0o100),
            )
        )
    return files


def make_task(spec: RepoTaskSpec, base_dir: Path) -> common_pb2.Task:
    """The task a spec describes, with its workspace and hidden files read from disk."""
    what = f"repo task {spec.id!r}"
    hidden = read_tree(base_dir / spec.hidden_tests, what) if spec.hidden_tests else []
    return common_pb2.Task(
        task_id=spec.id,
        family="repo",
        split=spec.split,
        instruction=spec.instruction,
        files=read_tree(base_dir / spec.path, what),
        grading=common_pb2.GradingSpec(
            command=spec.test_command,
            hidden_files=hidden,
            timeout_s=spec.timeout_s,
            reward_mode=_REWARD_MODES[spec.reward_mode],
        ),
        metadata={"path": str((base_dir / spec.path).resolve())},
        difficulty=spec.difficulty,
    )


def load_specs(task_file: Path) -> list[RepoTaskSpec]:
    """The ``[[tasks]]`` of a repo task file; ValueError naming the file and the entry."""
    try:
        with task_file.open("rb") as handle:
            entries = tomllib.load(handle).get("tasks", [])
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{task_file}: cannot read the repo task file: {error}") from error
    specs = []
    for index, entry in enumerate(entries):
        try:
            specs.append(RepoTaskSpec.model_validate(entry))
        except ValidationError as error:
            raise ValueError(f"{task_file}: tasks[{index}]: {error}") from error
    return specs


class RepoFamily(TaskFamily):
    """Repository tasks from a TOML task file (see the module docstring)."""

    name = "repo"

    def __init__(self, task_file: str | Path) -> None:
        path = Path(task_file)
        self._tasks = [make_task(spec, path.parent) for spec in load_specs(path)]
        self.splits = tuple(dict.fromkeys(task.split for task in self._tasks))

    def tasks(self, split: str) -> list[common_pb2.Task]:
        self.check_split(split)
        return [task for task in self._tasks if task.split == split]

    def solution_files(
        self, task: common_pb2.Task, completion: str
    ) -> list[common_pb2.WorkspaceFile]:
        """A completion is a JSON object mapping workspace paths to their new content."""
        return files_from_json(task, completion)
