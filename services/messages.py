"""Checks of the shared messages of proto/etude/v1/common.proto (Task, ObjectRef, ...).

Every check raises InvalidArgument naming the field path the caller sent, so a
bad request is answered with INVALID_ARGUMENT and a message a person can act on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from services.api.v1 import common_pb2
from services.wire.errors import require, require_identifier, require_range
from services.wire.requests import MAX_EXACT_INT

_SHA256_HEX = re.compile(r"\A[0-9a-f]{64}\Z")

# The one definition of an object-store key that crosses a service boundary: parts
# joined by '/', each starting with a letter, digit or '_' (so never '', '.' or '..')
# and made of letters, digits and '._=+@,:-'; at most MAX_KEY_BYTES in all. Every key
# this accepts is one every store accepts (services.objectstore.base.check_key).
_KEY_PART = r"[A-Za-z0-9_][A-Za-z0-9._=+@,:-]{0,254}"
_OBJECT_KEY = re.compile(rf"\A{_KEY_PART}(?:/{_KEY_PART})*\Z")
MAX_KEY_BYTES = 1024
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
    """An object-store key (see _OBJECT_KEY): relative, no '..', no '//', bounded."""
    require(bool(key), field, "must not be empty")
    size = len(key.encode())
    require(size <= MAX_KEY_BYTES, field, f"at most {MAX_KEY_BYTES} bytes, got {size}")
    require(
        _OBJECT_KEY.match(key) is not None,
        field,
        f"{key[:80]!r} is not an object key ('/'-separated parts of letters, digits and "
        "'._=+@,:-', each starting with a letter, digit or '_')",
    )


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


def validate_grading(grading: common_pb2.GradingSpec, field: str) -> None:
    """A command, hidden files with safe paths, a timeout in [0, MAX_GRADING_TIMEOUT_S]."""
    require_command(grading.command, f"{field}.command")
    for index, file in enumerate(grading.hidden_files):
        require_relative_path(file.path, f"{field}.hidden_files[{index}].path")
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
    """A task has an id, a family, workspace files with safe paths and a grading command."""
    require_identifier(task.task_id, f"{field}.task_id")
    require_identifier(task.family, f"{field}.family")
    validate_grading(task.grading, f"{field}.grading")
    for index, file in enumerate(task.files):
        require_relative_path(file.path, f"{field}.files[{index}].path")
    if task.HasField("workspace_archive"):
        validate_object_ref(task.workspace_archive, f"{field}.workspace_archive")
    require(
        0 <= task.difficulty <= 1,
        f"{field}.difficulty",
        f"must be in [0, 1], got {task.difficulty}",
    )
