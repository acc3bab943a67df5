"""Errors a servicer raises; the server maps each to its gRPC status with the message.

Servicers never call ``context.abort`` themselves: they raise one of these and the
error interceptor (``services.wire.interceptors``) answers the caller, counts it and
records it on the span. Anything else that escapes a servicer is a bug: it is
logged with its traceback and answered with INTERNAL.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc

from services.config import IDENTIFIER


class ServiceError(Exception):
    """Base of the errors that reach the caller as a gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgument(ServiceError, ValueError):
    """Bad input. The message always starts with the offending field path."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class NotFound(ServiceError, LookupError):
    """The named thing (group, version, suite, workspace) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    """The request is well-formed but the state does not allow it (e.g. a lost lease)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    """The service cannot serve this now (not ready, dependency down); retrying may work."""

    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ServiceError):
    """A method of the contract that this release does not do yet."""

    code = grpc.StatusCode.UNIMPLEMENTED


T = TypeVar("T")

# \A and \Z: '$' would also match before a trailing newline.
_IDENTIFIER = re.compile(rf"\A{IDENTIFIER}\Z")


def require(condition: bool, field: str, problem: str) -> None:
    """Raises InvalidArgument(field, problem) unless `condition` holds."""
    if not condition:
        raise InvalidArgument(field, problem)


def require_identifier(value: str, field: str) -> None:
    """An id: 1-256 characters of letters, digits and ``._:/-``, not starting with a symbol."""
    require(bool(value), field, "must not be empty")
    require(
        _IDENTIFIER.match(value) is not None,
        field,
        f"{value[:80]!r} is not a valid id (letters, digits, '._:/-', at most 256 characters)",
    )


def require_range(value: float, field: str, low: float, high: float) -> None:
    """low <= value <= high (NaN is outside every range)."""
    if not low <= value <= high:

        def shown(number: float) -> str:
            return str(number) if isinstance(number, int) else f"{number:g}"

        raise InvalidArgument(
            field, f"must be in [{shown(low)}, {shown(high)}], got {shown(value)}"
        )


def require_text(value: str, field: str, most_bytes: int) -> None:
    """Free text (a reason, a token): at most `most_bytes` bytes of UTF-8, no NUL byte."""
    size = len(value.encode())
    require(size <= most_bytes, field, f"at most {most_bytes} bytes, got {size}")
    require("\x00" not in value, field, "must not contain a NUL byte")


async def unimplemented_stream(message: str, item_type: type[T]) -> AsyncIterator[T]:
    """A response stream of `item_type` that fails with UNIMPLEMENTED when first read."""
    raise Unimplemented(message)
    yield item_type()  # unreachable; makes this an async generator
