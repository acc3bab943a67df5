"""Hypothesis strategies for request bodies, built from the proto descriptors.

``request_bodies(descriptor)`` draws the bytes of a request: most are well-formed
messages whose fields take extreme, unknown and hostile values (integer limits,
2^53 +- 1, NaN and infinities, unknown enum numbers, empty and 70,000-character
strings, path-like keys with '..', '//' and NUL bytes); the rest are not messages
of that type at all (random bytes, a message cut short, known field numbers sent
with the wrong wire type). Nothing here is per-field: a field added to a ``.proto``
is fuzzed without a list to update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

MAX_DEPTH = 3
# How a message's values are drawn (see `messages`).
HOSTILE, PLAUSIBLE, TYPICAL = "hostile", "plausible", "typical"

_INT_EDGES = [
    0,
    1,
    -1,
    2,
    1000,
    1024,
    2**31 - 1,
    -(2**31),
    2**32 - 1,
    2**53 - 1,
    2**53,
    2**53 + 1,
    10**17,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
]
_FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 1e-300, 1e300, 3600.0, 3600.0001, math.inf, -math.inf]
_STRING_EDGES = [
    "",
    "a",
    "w",
    "t",
    "0123456789abcdef",
    "0123456789abcdef/0",
    "fedcba9876543210/1023",
    "synthetic",
    "synthetic-heldout",
    "humaneval",
    "rollouts/run/0123456789abcdef/0-a1.pb",
    "weights/run/v00000001/manifest.json",
    "../../etc/passwd",
    "a//b",
    "/etc/passwd",
    "a/./b",
    "worker-1\n",
    "a\x00b",
    "\x00",
    "é🦀\u202e",
    "%s%n{0}",
    "x" * 300,
    "y" * 70_000,
    "0" * 64,
]

_TYPICAL_STRINGS = [
    "w",
    "t-1",
    "synthetic",
    "synthetic-heldout",
    "0123456789abcdef",
    "0123456789abcdef/0",
    "0" * 64,
    "rollouts/run/0123456789abcdef/0-a1.pb",
]

_INT_RANGES: dict[int, tuple[int, int]] = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_WIRE_TYPE = {
    FieldDescriptor.TYPE_DOUBLE: 1,
    FieldDescriptor.TYPE_FIXED64: 1,
    FieldDescriptor.TYPE_SFIXED64: 1,
    FieldDescriptor.TYPE_FLOAT: 5,
    FieldDescriptor.TYPE_FIXED32: 5,
    FieldDescriptor.TYPE_SFIXED32: 5,
    FieldDescriptor.TYPE_STRING: 2,
    FieldDescriptor.TYPE_BYTES: 2,
    FieldDescriptor.TYPE_MESSAGE: 2,
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [value for value in _INT_EDGES if low <= value <= high] + [low, high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Values of one scalar or enum field, extremes first."""
    kind = field.type
    if kind in _INT_RANGES:
        return _integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        defined = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(defined), _integers(-(2**31), 2**31 - 1))
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        width = 32 if kind == FieldDescriptor.TYPE_FLOAT else 64
        return st.one_of(st.sampled_from(_FLOAT_EDGES), st.floats(width=width))
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(_STRING_EDGES), st.text(max_size=40))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.just(b""), st.binary(max_size=64), st.just(b"\x00" * 70_000))
    raise AssertionError(f"no strategy for field type {kind} of {field.full_name}")


def typical(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Everyday values of a scalar or enum field: the ones a well-behaved caller sends."""
    kind = field.type
    # Zeros (and so the UNSPECIFIED enum values) are among the hostile values.
    if kind in _INT_RANGES:
        return st.integers(1, 3)
    if kind == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return st.sampled_from([v.number for v in field.enum_type.values if v.number] or [0])
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.sampled_from([0.5, 1.0])
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return st.sampled_from(_TYPICAL_STRINGS)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.sampled_from([b"", b"x = 1\n"])
    raise AssertionError(f"no strategy for field type {kind} of {field.full_name}")


def _value(field: FieldDescriptor, mode: str) -> st.SearchStrategy[Any]:
    """A scalar of the mode: hostile, everyday, or everyday with a hostile one now and then."""
    if mode == HOSTILE:
        return scalar(field)
    if mode == TYPICAL:
        return typical(field)
    return st.one_of(*[typical(field)] * 7, scalar(field))


def _field_values(field: FieldDescriptor, depth: int, mode: str) -> st.SearchStrategy[Any] | None:
    """A strategy for the field's value (a list for repeated fields), or None past MAX_DEPTH."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key = _value(field.message_type.fields_by_name["key"], mode)
        value_field = field.message_type.fields_by_name["value"]
        value = _single(value_field, depth + 1, mode)
        if value is None:
            return None
        return st.dictionaries(key, value, max_size=3)
    single = _single(field, depth, mode)
    if single is None:
        return None
    if field.is_repeated:
        return st.lists(single, min_size=0 if mode == HOSTILE else 1, max_size=3)
    return single


def _single(field: FieldDescriptor, depth: int, mode: str) -> st.SearchStrategy[Any] | None:
    if field.message_type is None:
        return _value(field, mode)
    if depth >= MAX_DEPTH:
        return None
    return messages(field.message_type, depth + 1, mode)


def _build(descriptor: Descriptor) -> Callable[[dict[str, Any]], Message]:
    cls = message_factory.GetMessageClass(descriptor)

    def build(values: dict[str, Any]) -> Message:
        message = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = descriptor.fields_by_name[name]
            target = getattr(message, name)
            if isinstance(value, dict):
                for key, item in value.items():
                    if isinstance(item, Message):
                        target[key].CopyFrom(item)
                    else:
                        target[key] = item
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, Message):
                        target.add().CopyFrom(item)
                    else:
                        target.append(item)
            elif field.message_type is not None:
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return build


def messages(
    descriptor: Descriptor, depth: int = 0, mode: str = HOSTILE
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type; each field is left unset or given a drawn value.
    HOSTILE draws extremes; TYPICAL everyday values (and sets most fields), so that
    requests get past validation to the state machine behind it; PLAUSIBLE is TYPICAL
    with a hostile value here and there."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        values = _field_values(field, depth, mode)
        if values is not None:
            # An everyday request sets every scalar field and some messages; a plausible
            # one most fields.
            branches = {
                HOSTILE: [st.none(), values],
                PLAUSIBLE: [values, values, st.none()],
                TYPICAL: [values] if field.message_type is None else [values, st.none()],
            }[mode]
            fields[field.name] = st.one_of(*branches)
    return st.fixed_dictionaries(fields).map(_build(descriptor))


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


@st.composite
def _wrong_wire_types(draw: st.DrawFn, descriptor: Descriptor) -> bytes:
    """Known field numbers, each sent with a wire type its field does not have."""
    body = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        numbers = [field.number for field in descriptor.fields] or [1]
        number = draw(st.sampled_from(numbers))
        field = descriptor.fields_by_number.get(number)
        right = _WIRE_TYPE.get(field.type, 0) if field is not None else 0
        wire = draw(st.sampled_from([w for w in (0, 1, 2, 5) if w != right]))
        body += _varint(number << 3 | wire)
        if wire == 0:
            body += _varint(draw(st.integers(0, 2**64 - 1)))
        elif wire == 1:
            body += draw(st.binary(min_size=8, max_size=8))
        elif wire == 5:
            body += draw(st.binary(min_size=4, max_size=4))
        else:
            payload = draw(st.binary(max_size=16))
            body += _varint(len(payload)) + payload
    return bytes(body)


def request_bodies(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Bodies for a method taking `descriptor`: mostly messages, some not."""
    serialized = messages(descriptor).map(lambda message: message.SerializeToString())
    plausible = messages(descriptor, mode=PLAUSIBLE).map(
        lambda message: message.SerializeToString()
    )
    everyday = messages(descriptor, mode=TYPICAL).map(lambda message: message.SerializeToString())
    cut = serialized.filter(lambda body: len(body) > 1).flatmap(
        lambda body: st.integers(1, len(body) - 1).map(lambda end: body[:end])
    )
    return st.one_of(
        everyday,
        plausible,
        everyday,
        serialized,
        st.binary(max_size=64),
        cut,
        _wrong_wire_types(descriptor),
    )
