"""Checks of the shared messages of proto/etude/v1/common.proto (Task, ObjectRef, ...).

Every check raises InvalidArgument naming the field path the caller sent, so a
bad request is answered with INVALID_ARGUMENT and a message a person can act on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from services.api.v1 import common_pb2
from services.objectstore.base import key_problem
from services.wire.errors import require, require_identifier, require_range, require_text
from services.wire.requests import MAX_EXACT_INT

_SHA256_HEX = re.compile(r"\A[0-9a-f]{64}\Z")

# Workspace paths: what Linux takes (PATH_MAX, NAME_MAX).
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
# A command line: at most this many arguments, each at most MAX_ARG_BYTES (Linux's
# MAX_ARG_STRLEN), and with the environment at most MAX_COMMAND_BYTES in all.
MAX_ARGS = 4096
MAX_ARG_BYTES = 128 * 1024
MAX_COMMAND_BYTES = 1024 * 1024
MAX_ENV_VARS = 1024
_ENV_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]{0,255}\Z")
MAX_GRADING_TIMEOUT_S = 3600.0
# A task's text and inline files. Inline workspaces stay well inside a gRPC message
# (64 MiB by default); larger ones travel as a workspace_archive in the object store.
MAX_INSTRUCTION_BYTES = 1024 * 1024
MAX_SPLIT_BYTES = 64
MAX_METADATA_ENTRIES = 256
MAX_METADATA_KEY_BYTES = 256
MAX_METADATA_VALUE_BYTES = 64 * 1024
MAX_FILES = 4096
MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_INLINE_FILES_BYTES = 32 * 1024 * 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def require_relative_path(path: str, field: str) -> None:
    """A relative POSIX path that stays inside its root: no leading '/', no '', '.' or
    '..' part, no control character, at most MAX_PATH_BYTES (MAX_NAME_BYTES a part)."""
    require(bool(path), field, "must not be empty")
    size = len(path.encode())
    require(size <= MAX_PATH_BYTES, field, f"at most {MAX_PATH_BYTES} bytes, got {size}")
    parts = path.split("/")
    require(
        not path.startswith("/")
        and not any(part in ("", ".", "..") for part in parts)
        and _CONTROL.search(path) is None,
        field,
        f"{path[:80]!r} must be a relative path without '', '.' or '..' parts "
        "or control characters",
    )
    longest = max(len(part.encode()) for part in parts)
    require(
        longest <= MAX_NAME_BYTES, field, f"a part is at most {MAX_NAME_BYTES} bytes, got {longest}"
    )


def require_object_key(key: str, field: str) -> None:
    """An object-store key by the one definition (``services.objectstore.base.key_problem``):
    relative, no '', '.' or '..' part, bounded."""
    problem = key_problem(key)
    require(problem is None, field, problem or "")


def require_command(
    argv: Sequence[str], field: str, env: Mapping[str, str] | None = None, env_field: str = "env"
) -> None:
    """An argv (and environment) the kernel can exec: 1..MAX_ARGS arguments, the first
    not empty, no NUL byte anywhere, variable names of letters, digits and '_', within
    Linux's size limits."""
    require(len(argv) > 0, field, "must not be empty")
    require(len(argv) <= MAX_ARGS, field, f"at most {MAX_ARGS} arguments, got {len(argv)}")
    require(bool(argv[0]), f"{field}[0]", "must not be empty")
    total = 0
    for index, arg in enumerate(argv):
        size = len(arg.encode())
        require(size <= MAX_ARG_BYTES, f"{field}[{index}]", f"at most {MAX_ARG_BYTES} bytes")
        require("\x00" not in arg, f"{field}[{index}]", "must not contain a NUL byte")
        total += size + 1
    env = env or {}
    require(len(env) <= MAX_ENV_VARS, env_field, f"at most {MAX_ENV_VARS} variables")
    for name, value in env.items():
        entry = f"{env_field}[{name[:40]!r}]"
        require(
            _ENV_NAME.match(name) is not None,
            entry,
            "a variable name is 1-256 letters, digits or '_', not starting with a digit",
        )
        size = len(value.encode())
        require(size <= MAX_ARG_BYTES, entry, f"a value is at most {MAX_ARG_BYTES} bytes")
        require("\x00" not in value, entry, "must not contain a NUL byte")
        total += len(name) + size + 2
    require(
        total <= MAX_COMMAND_BYTES,
        field,
        f"arguments and environment are at most {MAX_COMMAND_BYTES} bytes, got {total}",
    )


def validate_files(files: Sequence[common_pb2.WorkspaceFile], field: str) -> None:
    """At most MAX_FILES files with safe paths, each at most MAX_FILE_BYTES and all
    together at most MAX_INLINE_FILES_BYTES."""
    require(len(files) <= MAX_FILES, field, f"at most {MAX_FILES} files, got {len(files)}")
    total = 0
    for index, file in enumerate(files):
        require_relative_path(file.path, f"{field}[{index}].path")
        size = len(file.content)
        require(
            size <= MAX_FILE_BYTES,
            f"{field}[{index}].content",
            f"at most {MAX_FILE_BYTES} bytes, got {size}",
        )
        total += size
    require(
        total <= MAX_INLINE_FILES_BYTES,
        field,
        f"at most {MAX_INLINE_FILES_BYTES} bytes of content in all, got {total} "
        "(a larger workspace travels as workspace_archive)",
    )


def validate_grading(grading: common_pb2.GradingSpec, field: str) -> None:
    """A command, hidden files with safe paths, a timeout in [0, MAX_GRADING_TIMEOUT_S]."""
    require_command(grading.command, f"{field}.command")
    validate_files(grading.hidden_files, f"{field}.hidden_files")
    require_range(grading.timeout_s, f"{field}.timeout_s", 0, MAX_GRADING_TIMEOUT_S)


def validate_object_ref(ref: common_pb2.ObjectRef, field: str) -> None:
    """A key and the SHA-256 of the stored bytes."""
    require_object_key(ref.key, f"{field}.key")
    require(
        _SHA256_HEX.match(ref.sha256) is not None,
        f"{field}.sha256",
        "must be 64 lower-case hex digits",
    )


def validate_version_notice(notice: common_pb2.PolicyVersionNotice, field: str = "") -> None:
    """A version in 1..2^53-1 and the object key of its manifest; `field` is the path
    of the notice in the request ('' when the request is the notice itself)."""
    prefix = f"{field}." if field else ""
    require_range(notice.version, f"{prefix}version", 1, MAX_EXACT_INT)
    require_object_key(notice.manifest_key, f"{prefix}manifest_key")


def validate_task(task: common_pb2.Task, field: str) -> None:
    """A task has an id, a family, bounded text without NUL bytes (split, instruction,
    metadata), bounded workspace files with safe paths and a grading command."""
    require_identifier(task.task_id, f"{field}.task_id")
    require_identifier(task.family, f"{field}.family")
    require_text(task.split, f"{field}.split", MAX_SPLIT_BYTES)
    require_text(task.instruction, f"{field}.instruction", MAX_INSTRUCTION_BYTES)
    require(
        len(task.metadata) <= MAX_METADATA_ENTRIES,
        f"{field}.metadata",
        f"at most {MAX_METADATA_ENTRIES} entries, got {len(task.metadata)}",
    )
    for key, value in task.metadata.items():
        entry = f"{field}.metadata[{key[:40]!r}]"
        require(bool(key), entry, "a key must not be empty")
        require_text(key, entry, MAX_METADATA_KEY_BYTES)
        require_text(value, entry, MAX_METADATA_VALUE_BYTES)
    validate_grading(task.grading, f"{field}.grading")
    validate_files(task.files, f"{field}.files")
    if task.HasField("workspace_archive"):
        validate_object_ref(task.workspace_archive, f"{field}.workspace_archive")
    require(
        0 <= task.difficulty <= 1,
        f"{field}.difficulty",
        f"must be in [0, 1], got {task.difficulty}",
    )
