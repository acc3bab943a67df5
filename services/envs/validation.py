"""Checks of envs requests; failures name the field."""

from __future__ import annotations

from services.api.v1 import envs_pb2
from services.messages import require_command, validate_grading, validate_task
from services.wire.errors import require, require_identifier, require_range

MAX_FORKS = 256
MAX_EXEC_TIMEOUT_S = 3600.0
# What a command reads on its standard input; larger input belongs in a workspace file.
MAX_STDIN_BYTES = 16 * 1024 * 1024


def validate_create(request: envs_pb2.CreateWorkspaceRequest) -> None:
    """A valid task to build the workspace from."""
    require(request.HasField("task"), "task", "must be set")
    validate_task(request.task, "task")


def validate_fork(request: envs_pb2.ForkWorkspaceRequest) -> None:
    """A source workspace or snapshot and 1..MAX_FORKS forks."""
    require_identifier(request.source_id, "source_id")
    require_range(request.num_forks, "num_forks", 1, MAX_FORKS)


def validate_exec(request: envs_pb2.ExecRequest) -> None:
    """A workspace, an argv and environment the kernel can exec (no NUL byte, within
    Linux's sizes; ``services.messages.require_command``), a timeout within bounds and at
    most MAX_STDIN_BYTES of standard input."""
    require_identifier(request.workspace_id, "workspace_id")
    require_command(request.argv, "argv", request.env, "env")
    require_range(request.timeout_s, "timeout_s", 0, MAX_EXEC_TIMEOUT_S)
    size = len(request.stdin)
    require(size <= MAX_STDIN_BYTES, "stdin", f"at most {MAX_STDIN_BYTES} bytes, got {size}")


def validate_grade(request: envs_pb2.GradeRequest) -> None:
    """A workspace and, when given, a grading command, files and timeout."""
    require_identifier(request.workspace_id, "workspace_id")
    if request.HasField("grading"):
        validate_grading(request.grading, "grading")
