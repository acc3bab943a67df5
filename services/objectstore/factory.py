"""Opening the object store a config names."""

from __future__ import annotations

from pathlib import Path

from services.config import ObjectStoreConfig
from services.objectstore.base import ObjectStore


def open_store(config: ObjectStoreConfig) -> ObjectStore:
    """``file://<dir>`` or ``s3://<bucket>[/<prefix>]``."""
    url = config.url
    if url.startswith("file://"):
        from services.objectstore.local import FileObjectStore

        return FileObjectStore(Path(url.removeprefix("file://")))
    if url.startswith("s3://"):
        from services.objectstore.s3 import S3ObjectStore

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"object_store.url {url!r} names no bucket (s3://<bucket>[/<prefix>])")
        return S3ObjectStore(bucket, prefix, config)
    raise ValueError(f"object_store.url {url!r}: only file:// and s3:// are supported")
