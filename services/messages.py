"""Checks of the shared messages of proto/etude/v1/common.proto (Task, ObjectRef, ...).

Every check raises InvalidArgument naming the field path the caller sent, so a
bad request is answered with INVALID_ARGUMENT and a message a person can act on.
"""

from __future__ import annotations

import re

from services.api.v1 import common_pb2
from services.wire.errors import require, require_identifier

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def require_relative_path(path: str, field: str) -> None:
    """A relative POSIX path that stays inside its root: no leading '/', no '..'."""
    require(bool(path), field, "must not be empty")
    require(
        not path.startswith("/") and ".." not in path.split("/") and "\x00" not in path,
        field,
        f"{path[:80]!r} must be a relative path without '..'",
    )


def validate_object_ref(ref: common_pb2.ObjectRef, field: str) -> None:
    """A key and the SHA-256 of the stored bytes."""
    require(bool(ref.key), f"{field}.key", "must not be empty")
    require(
        _SHA256_HEX.match(ref.sha256) is not None,
        f"{field}.sha256",
        "must be 64 lower-case hex digits",
    )


def validate_task(task: common_pb2.Task, field: str) -> None:
    """A task has an id, a family, workspace files with safe paths and a grading command."""
    require_identifier(task.task_id, f"{field}.task_id")
    require_identifier(task.family, f"{field}.family")
    require(len(task.grading.command) > 0, f"{field}.grading.command", "must not be empty")
    for index, file in enumerate(task.files):
        require_relative_path(file.path, f"{field}.files[{index}].path")
    for index, file in enumerate(task.grading.hidden_files):
        require_relative_path(file.path, f"{field}.grading.hidden_files[{index}].path")
    if task.HasField("workspace_archive"):
        validate_object_ref(task.workspace_archive, f"{field}.workspace_archive")
    require(
        0 <= task.difficulty <= 1,
        f"{field}.difficulty",
        f"must be in [0, 1], got {task.difficulty}",
    )
