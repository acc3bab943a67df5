"""The object-store interface."""

from __future__ import annotations

import abc
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

Bytes = bytes | bytearray | memoryview


class ObjectStoreError(RuntimeError):
    """An object-store operation failed (after retries); the message names the key."""


class ObjectNotFound(ObjectStoreError, LookupError):
    """The key does not exist."""


@dataclass(frozen=True)
class ObjectInfo:
    """What was stored: key, size and SHA-256 of the bytes."""

    key: str
    size: int
    sha256: str


def sha256_hex(data: Bytes) -> str:
    """Lower-case hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()


class InvalidObjectKey(ValueError):
    """A key no store can hold (``check_key``): no retry will find an object there."""


# The one definition of an object key, for every store and every service boundary
# (``services.messages.require_object_key`` answers INVALID_ARGUMENT with it): parts
# joined by '/', each starting with a letter, digit or '_' (so never '', '.' or '..')
# and made of letters, digits and '._=+@,:-'; at most MAX_KEY_BYTES in all. Such a key
# is a safe relative path under a directory and a valid S3 key.
_KEY_PART = r"[A-Za-z0-9_][A-Za-z0-9._=+@,:-]{0,254}"
_OBJECT_KEY = re.compile(rf"\A{_KEY_PART}(?:/{_KEY_PART})*\Z")
MAX_KEY_BYTES = 1024


def key_problem(key: str) -> str | None:
    """Why `key` is not an object key (see above), or None when it is one."""
    if not key:
        return "must not be empty"
    size = len(key.encode())
    if size > MAX_KEY_BYTES:
        return f"at most {MAX_KEY_BYTES} bytes, got {size}"
    if _OBJECT_KEY.match(key) is None:
        return (
            f"{key[:80]!r} is not an object key ('/'-separated parts of letters, digits "
            "and '._=+@,:-', each starting with a letter, digit or '_')"
        )
    return None


def check_key(key: str) -> str:
    """`key` itself when it is an object key; InvalidObjectKey saying why otherwise."""
    problem = key_problem(key)
    if problem is not None:
        raise InvalidObjectKey(f"invalid object key: {problem}")
    return key


class ObjectStore(abc.ABC):
    """Keys to immutable-until-rewritten blobs. Every method is safe to call from threads."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: Bytes) -> ObjectInfo:
        """Stores `data` at `key` atomically (readers never see part of it)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; ObjectNotFound when absent."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes; ObjectNotFound when absent."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted."""

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Deletes the keys (absent ones are ignored)."""

    def exists(self, key: str) -> bool:
        """True when `key` exists."""
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True
