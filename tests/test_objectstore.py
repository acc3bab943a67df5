"""The object store against the real filesystem and a real S3-API server (moto over HTTP)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from services.config import ObjectStoreConfig
from services.messages import require_object_key
from services.objectstore import ObjectNotFound, ObjectStore, ObjectStoreError, open_store
from services.objectstore.base import InvalidObjectKey, check_key
from services.objectstore.local import FileObjectStore
from services.objectstore.s3 import RETRIES, S3ObjectStore
from services.wire.errors import InvalidArgument
from tests.objectstore_support import (
    MIN_PART,
    FaultyProxy,
    make_bucket,
    s3_config,
    s3_store,
)


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return FileObjectStore(tmp_path / "store")
    return s3_store(request.getfixturevalue("moto_endpoint"))


def test_put_get_list_delete(store: ObjectStore) -> None:
    info = store.put("weights/run/v1/a.bin", b"hello")
    assert (info.size, info.sha256) == (5, hashlib.sha256(b"hello").hexdigest())
    store.put("weights/run/v1/b.bin", b"")
    store.put("weights/run/v2/a.bin", b"x" * 10)
    assert store.get("weights/run/v1/a.bin") == b"hello"
    assert store.get("weights/run/v1/b.bin") == b""
    assert store.get_range("weights/run/v2/a.bin", 2, 5) == b"xxx"
    assert store.size("weights/run/v2/a.bin") == 10
    assert store.list("weights/run/v1/") == ["weights/run/v1/a.bin", "weights/run/v1/b.bin"]
    assert store.exists("weights/run/v1/a.bin") and not store.exists("weights/run/v9/a.bin")
    store.put("weights/run/v1/a.bin", b"rewritten")
    assert store.get("weights/run/v1/a.bin") == b"rewritten"
    store.delete(["weights/run/v1/a.bin", "weights/run/never"])
    with pytest.raises(ObjectNotFound, match=r"weights/run/v1/a\.bin"):
        store.get("weights/run/v1/a.bin")
    with pytest.raises(ObjectNotFound):
        store.size("nope")


def test_large_objects_round_trip_in_parts(store: ObjectStore) -> None:
    data = os.urandom(10 * MIN_PART + 123)  # above the multipart threshold and 2 x part size
    store.put("big.bin", data)
    assert store.get("big.bin") == data
    assert (
        store.get_range("big.bin", MIN_PART - 5, 3 * MIN_PART + 7)
        == data[MIN_PART - 5 : 3 * MIN_PART + 7]
    )


BAD_KEYS = ["", "/abs", "a/../b", "a//b", "./a", "a/", "a b", ".hidden", "a\nb", "k" * 1025]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(InvalidObjectKey, match="invalid object key"):
        store.put(key, b"x")


@pytest.mark.parametrize("key", [*BAD_KEYS, "rollouts/run/g-1:0/3.pb", "w/v12/manifest.json"])
def test_one_key_definition_for_stores_and_requests(key: str) -> None:
    """A key a request may carry is exactly a key every store can hold."""
    try:
        require_object_key(key, "key")
        accepted_at_boundary = True
    except InvalidArgument:
        accepted_at_boundary = False
    try:
        check_key(key)
        accepted_by_stores = True
    except InvalidObjectKey:
        accepted_by_stores = False
    assert accepted_at_boundary == accepted_by_stores == (key not in BAD_KEYS)


def test_file_store_never_shows_partial_files(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    store.put("a/b.bin", b"1" * 1000)
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]  # no temporaries left


def test_multipart_upload_is_used_and_atomic(moto_endpoint: str) -> None:
    store = s3_store(moto_endpoint)
    data = os.urandom(6 * MIN_PART)
    store.put("parts.bin", data)
    head = store._client.head_object(Bucket=store.bucket, Key="runs/parts.bin")
    assert head["ETag"].strip('"').endswith("-6")  # an S3 multipart ETag: 6 parts
    # A failed multipart upload leaves neither the object nor its parts.
    broken = S3ObjectStore(
        store.bucket, "runs", s3_config(moto_endpoint, store.bucket, max_attempts=1)
    )
    original = broken._client.complete_multipart_upload

    def fail(**kwargs: object) -> None:
        raise ObjectStoreError("injected failure before completing")

    broken._client.complete_multipart_upload = fail
    with pytest.raises(ObjectStoreError):
        broken.put("half.bin", data)
    broken._client.complete_multipart_upload = original
    assert not store.exists("half.bin")
    uploads = store._client.list_multipart_uploads(Bucket=store.bucket)
    assert not uploads.get("Uploads")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["throttle", "drop"])
def test_throttling_and_dropped_connections_are_retried(moto_endpoint: str, mode: str) -> None:
    bucket = make_bucket(moto_endpoint)
    proxy = FaultyProxy(moto_endpoint, failures=3, methods={"PUT", "GET"}, mode=mode)
    try:
        config = s3_config(proxy.endpoint, bucket, max_attempts=5, max_backoff_s=0.05)
        store = S3ObjectStore(bucket, "runs", config)
        before = _retries()
        store.put("flaky.bin", b"payload")
        assert store.get("flaky.bin") == b"payload"
        assert proxy.failed == 3 and _retries() - before == 3
        # Bounded: more failures than tries is an error naming the key.
        proxy.remaining = 10
        few = S3ObjectStore(
            bucket, "runs", s3_config(proxy.endpoint, bucket, max_attempts=2, max_backoff_s=0.01)
        )
        with pytest.raises(ObjectStoreError, match=r"flaky2\.bin"):
            few.put("flaky2.bin", b"x")
    finally:
        proxy.close()


def _retries() -> float:
    return sum(
        sample.value
        for metric in RETRIES.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


def test_open_store_by_url(tmp_path: Path, moto_endpoint: str) -> None:
    assert isinstance(open_store(ObjectStoreConfig(url=f"file://{tmp_path}")), FileObjectStore)
    bucket = make_bucket(moto_endpoint)
    store = open_store(s3_config(moto_endpoint, bucket))
    assert isinstance(store, S3ObjectStore) and store.url == f"s3://{bucket}/runs"
    with pytest.raises(ValueError, match="names no bucket"):
        open_store(ObjectStoreConfig(url="s3://"))
