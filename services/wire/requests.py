"""Decoding request bodies and the checks every request gets, from the proto descriptors.

The server hands each servicer a message that passed these checks (see
``services.wire.interceptors``): the body parsed, after authentication; every enum
field holds a value its enum defines (proto3 keeps unknown numbers, which would
otherwise reach the servicer); every floating-point field is finite; every 64-bit
integer lies within ±(2^53 - 1), so it stays exact in Lua, JSON and doubles. A
failure is INVALID_ARGUMENT naming the field path. The checks are derived from the
descriptors, so a field added to a ``.proto`` is covered without a list to update.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from services.wire.errors import InvalidArgument

# The largest integer every party (Lua numbers in Redis, JSON readers, float64) holds
# exactly; versions, steps and every other 64-bit field of a request stay within it.
MAX_EXACT_INT = 2**53 - 1

_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}
_FLOAT = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT}
_CHECKED = _INT64 | _FLOAT | {FieldDescriptor.TYPE_ENUM}


@functools.cache
def _needs_checks(descriptor: Descriptor) -> bool:
    """Whether a message of this type (or one inside it) has a field the checks look at."""
    seen: set[str] = set()

    def walk(desc: Descriptor) -> bool:
        if desc.full_name in seen:
            return False
        seen.add(desc.full_name)
        for field in desc.fields:
            if field.type in _CHECKED:
                return True
            if field.message_type is not None and walk(field.message_type):
                return True
        return False

    return walk(descriptor)


def _check_scalar(field: FieldDescriptor, value: Any, path: str) -> None:
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum = field.enum_type
        assert enum is not None, "an enum field has an enum type"
        if enum.values_by_number.get(value) is None:
            known = ", ".join(v.name for v in enum.values)
            raise InvalidArgument(path, f"{value} is not a {enum.name} ({known})")
    elif field.type in _FLOAT:
        if not math.isfinite(value):
            raise InvalidArgument(path, f"must be a finite number, got {value}")
    elif field.type in _INT64 and not -MAX_EXACT_INT <= value <= MAX_EXACT_INT:
        raise InvalidArgument(path, f"must be within ±{MAX_EXACT_INT} (2^53 - 1), got {value}")


def check_message(message: Message, prefix: str = "") -> None:
    """Raises InvalidArgument for the first enum, float or 64-bit field out of range."""
    if not _needs_checks(message.DESCRIPTOR):
        return
    for field, value in message.ListFields():
        if field.message_type is None and field.type not in _CHECKED:
            continue  # token ids, strings, bytes: nothing to check here
        if field.message_type is not None and not _needs_checks(field.message_type):
            continue
        path = f"{prefix}{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                item_path = f"{path}[{key!r}]"
                if value_field.message_type is not None:
                    check_message(item, f"{item_path}.")
                else:
                    _check_scalar(value_field, item, item_path)
        elif field.is_repeated:
            for index, item in enumerate(value):
                if field.message_type is not None:
                    check_message(item, f"{path}[{index}].")
                else:
                    _check_scalar(field, item, f"{path}[{index}]")
        elif field.message_type is not None:
            check_message(value, f"{path}.")
        else:
            _check_scalar(field, value, path)


class RateLimitedLog:
    """Logs at most `burst` messages per `interval_s`, then one line saying how many it skipped."""

    def __init__(self, logger: logging.Logger, burst: int = 3, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._burst = burst
        self._interval_s = interval_s
        self._window_start = -math.inf
        self._logged = 0
        self._skipped = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> None:
        """Logs `message` at WARNING unless this window's burst is spent."""
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self._interval_s:
                if self._skipped:
                    self._logger.warning("... and %d more like it", self._skipped)
                self._window_start, self._logged, self._skipped = now, 0, 0
            if self._logged >= self._burst:
                self._skipped += 1
                return
            self._logged += 1
        self._logger.warning(message, *args)


def request_decoder(
    deserializer: Callable[[bytes], Message], method: str, bad_bodies: RateLimitedLog
) -> Callable[[bytes], Message]:
    """Parses a request body and checks it; INVALID_ARGUMENT ("request: ...") when it does not
    parse, with a rate-limited WARNING (a caller cannot flood the log)."""
    type_name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = type_name.name if type_name is not None else "request"

    def decode(body: bytes) -> Message:
        try:
            message = deserializer(body)
        except (DecodeError, ValueError, TypeError) as error:
            bad_bodies.warning("%s: a body that is not a %s (%s)", method, name, error)
            raise InvalidArgument("request", f"the body is not a valid {name} message") from None
        check_message(message)
        return message

    return decode
