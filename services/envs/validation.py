"""Checks of envs requests; failures name the field."""

from __future__ import annotations

from services.api.v1 import envs_pb2
from services.messages import require_relative_path, validate_task
from services.wire.errors import require, require_identifier, require_range

MAX_FORKS = 256
MAX_EXEC_TIMEOUT_S = 3600.0


def validate_create(request: envs_pb2.CreateWorkspaceRequest) -> None:
    """A valid task to build the workspace from."""
    require(request.HasField("task"), "task", "must be set")
    validate_task(request.task, "task")


def validate_fork(request: envs_pb2.ForkWorkspaceRequest) -> None:
    """A source workspace or snapshot and 1..MAX_FORKS forks."""
    require_identifier(request.source_id, "source_id")
    require_range(request.num_forks, "num_forks", 1, MAX_FORKS)


def validate_exec(request: envs_pb2.ExecRequest) -> None:
    """A workspace, a non-empty argv and a timeout within bounds."""
    require_identifier(request.workspace_id, "workspace_id")
    require(len(request.argv) > 0, "argv", "must not be empty")
    require(bool(request.argv[0]), "argv[0]", "must not be empty")
    require_range(request.timeout_s, "timeout_s", 0, MAX_EXEC_TIMEOUT_S)
    for name in request.env:
        require(
            bool(name) and "=" not in name and "\x00" not in name,
            f"env[{name!r}]",
            "is not a valid environment variable name",
        )


def validate_grade(request: envs_pb2.GradeRequest) -> None:
    """A workspace and, when given, a grading command."""
    require_identifier(request.workspace_id, "workspace_id")
    if request.HasField("grading"):
        require(len(request.grading.command) > 0, "grading.command", "must not be empty")
        for index, file in enumerate(request.grading.hidden_files):
            require_relative_path(file.path, f"grading.hidden_files[{index}].path")
