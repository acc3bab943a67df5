"""The ``file://`` backend: one file per key under a root directory."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from services.objectstore.base import (
    Bytes,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    check_key,
    sha256_hex,
)


class FileObjectStore(ObjectStore):
    """Objects as files; a put writes a temporary file, fsyncs it and renames it into place."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: Bytes) -> ObjectInfo:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        return ObjectInfo(key, len(data), sha256_hex(data))

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as error:
            raise ObjectNotFound(f"{self.url}/{key} does not exist") from error

    def get_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with self._path(key).open("rb") as file:
                file.seek(start)
                return file.read(end - start)
        except FileNotFoundError as error:
            raise ObjectNotFound(f"{self.url}/{key} does not exist") from error

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError as error:
            raise ObjectNotFound(f"{self.url}/{key} does not exist") from error

    def list(self, prefix: str) -> list[str]:
        keys = []
        for path in self.root.rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
