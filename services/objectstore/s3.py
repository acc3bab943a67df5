"""The ``s3://bucket/prefix`` backend on boto3 (AWS S3, MinIO, moto, ...).

Retries are this module's, not botocore's (which is set to one attempt), so they
are bounded, logged and counted in one place: throttling (SlowDown, 503), other
5xx, timeouts and dropped connections are retried with exponential backoff and
full jitter. Large objects are uploaded in parallel multipart parts (the object
appears only when the upload completes, so readers never see part of it) and
downloaded in parallel byte ranges.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from prometheus_client import Counter

from services.config import ObjectStoreConfig
from services.objectstore.base import (
    Bytes,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    check_key,
    sha256_hex,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRIES = Counter(
    "etude_objectstore_retries",
    "Object-store requests retried, by reason.",
    ["operation", "reason"],
)
_RETRYABLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestLimitExceeded",
    "InternalError",
    "ServiceUnavailable",
}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_TRANSIENT = (ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError)


def _retryable(error: ClientError) -> str | None:
    code = str(error.response.get("Error", {}).get("Code", ""))
    status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    if code in _RETRYABLE_CODES or status == 429 or status >= 500:
        return code or str(status)
    return None


class S3ObjectStore(ObjectStore):
    """Objects under ``s3://bucket/prefix``."""

    def __init__(self, bucket: str, prefix: str, config: ObjectStoreConfig) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.config = config
        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            config=Config(
                retries={"total_max_attempts": 1},
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                max_pool_connections=max(10, 2 * config.max_concurrency),
                s3={"addressing_style": "path"} if config.endpoint_url else None,
            ),
        )

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _retry(self, operation: str, key: str, call: Callable[[], T]) -> T:
        attempts = self.config.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                return call()
            except ClientError as error:
                code = str(error.response.get("Error", {}).get("Code", ""))
                if code in _NOT_FOUND_CODES:
                    raise ObjectNotFound(f"{self.url}/{key} does not exist") from error
                reason = _retryable(error)
                if reason is None or attempt == attempts:
                    raise ObjectStoreError(f"{operation} {self.url}/{key}: {error}") from error
            except _TRANSIENT as error:
                reason = type(error).__name__
                if attempt == attempts:
                    raise ObjectStoreError(f"{operation} {self.url}/{key}: {error}") from error
            RETRIES.labels(operation, reason).inc()
            delay = random.uniform(0, min(self.config.max_backoff_s, 0.1 * 2 ** (attempt - 1)))
            log.warning(
                "%s %s: %s, retry %d/%d in %.2f s",
                operation,
                key,
                reason,
                attempt,
                attempts - 1,
                delay,
            )
            time.sleep(delay)
        raise AssertionError("unreachable: the loop returns or raises")

    def put(self, key: str, data: Bytes) -> ObjectInfo:
        body = bytes(data)
        if len(body) >= self.config.multipart_threshold_bytes:
            self._put_multipart(key, body)
        else:
            self._retry(
                "put",
                key,
                lambda: self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body),
            )
        return ObjectInfo(key, len(body), sha256_hex(body))

    def _put_multipart(self, key: str, body: bytes) -> None:
        full_key = self._key(key)
        part_size = self.config.part_size_bytes
        upload = self._retry(
            "create_multipart_upload",
            key,
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=full_key),
        )
        upload_id = upload["UploadId"]

        def part(number: int) -> dict[str, Any]:
            chunk = body[(number - 1) * part_size : number * part_size]
            answer = self._retry(
                "upload_part",
                key,
                lambda: self._client.upload_part(
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=chunk,
                ),
            )
            return {"PartNumber": number, "ETag": answer["ETag"]}

        count = -(-len(body) // part_size)
        try:
            with ThreadPoolExecutor(self.config.max_concurrency) as pool:
                parts = list(pool.map(part, range(1, count + 1)))
            self._retry(
                "complete_multipart_upload",
                key,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
        except BaseException:
            # Nothing was published; do not leave the parts billed in the bucket.
            try:
                self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=full_key, UploadId=upload_id
                )
            except (ClientError, *_TRANSIENT) as abort_error:
                log.warning("abort of multipart upload %s failed: %s", key, abort_error)
            raise

    def get(self, key: str) -> bytes:
        size = self.size(key)
        part_size = self.config.part_size_bytes
        if size < 2 * part_size:
            return self.get_range(key, 0, size) if size else b""
        ranges = [(start, min(start + part_size, size)) for start in range(0, size, part_size)]
        with ThreadPoolExecutor(self.config.max_concurrency) as pool:
            chunks = list(pool.map(lambda r: self.get_range(key, *r), ranges))
        return b"".join(chunks)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        answer = self._retry(
            "get",
            key,
            lambda: self._client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}"
            ),
        )
        data: bytes = answer["Body"].read()
        if len(data) != end - start:
            raise ObjectStoreError(
                f"get {self.url}/{key}: asked for bytes [{start}, {end}), got {len(data)} bytes"
            )
        return data

    def size(self, key: str) -> int:
        answer = self._retry(
            "head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        )
        return int(answer["ContentLength"])

    def list(self, prefix: str) -> list[str]:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._retry("list", prefix, partial(self._client.list_objects_v2, **kwargs))
            keys += [item["Key"][strip:] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(keys)
            token = page["NextContinuationToken"]

    def delete(self, keys: Iterable[str]) -> None:
        batch = [{"Key": self._key(k)} for k in keys]
        for start in range(0, len(batch), 1000):
            chunk = batch[start : start + 1000]
            self._retry(
                "delete",
                chunk[0]["Key"],
                partial(
                    self._client.delete_objects,
                    Bucket=self.bucket,
                    Delete={"Objects": chunk, "Quiet": True},
                ),
            )
