"""The object-store interface."""

from __future__ import annotations

import abc
import hashlib
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


def check_key(key: str) -> str:
    """Keys are relative POSIX paths without '..' or empty parts."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise InvalidObjectKey(
            f"invalid object key {key!r}: a relative path without '.', '..' or '//'"
        )
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
