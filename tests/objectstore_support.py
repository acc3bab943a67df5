"""Object stores for tests: a real S3-API server (moto) over HTTP, and a fault injector."""

from __future__ import annotations

import http.client
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3

from services.config import ObjectStoreConfig
from services.objectstore.s3 import S3ObjectStore

# Small parts so multipart uploads are exercised with test-sized data.
MIN_PART = 8 * 1024
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def s3_config(endpoint: str, bucket: str, **settings: object) -> ObjectStoreConfig:
    return ObjectStoreConfig(
        url=f"s3://{bucket}/runs",
        endpoint_url=endpoint,
        region="us-east-1",
        multipart_threshold_bytes=4 * MIN_PART,
        part_size_bytes=MIN_PART,
        max_concurrency=4,
        **settings,  # type: ignore[arg-type]
    )


def make_bucket(endpoint: str) -> str:
    bucket = f"etude-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


def s3_store(endpoint: str, **settings: object) -> S3ObjectStore:
    """An S3 store on a new bucket of the moto server."""
    bucket = make_bucket(endpoint)
    return S3ObjectStore(bucket, "runs", s3_config(endpoint, bucket, **settings))


class FaultyProxy:
    """An HTTP proxy in front of an S3 server that answers the first `failures` requests
    matching `methods` with 503 SlowDown (throttling), or drops the connection."""

    def __init__(
        self, upstream: str, failures: int, methods: set[str], mode: str = "throttle"
    ) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.remaining = failures
        self.methods = methods
        self.mode = mode
        self.failed = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                with proxy.lock:
                    fail = self.command in proxy.methods and proxy.remaining > 0
                    if fail:
                        proxy.remaining -= 1
                        proxy.failed += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if fail and proxy.mode == "drop":
                    self.connection.close()
                    return
                if fail:
                    payload = (
                        b"<Error><Code>SlowDown</Code>"
                        b"<Message>Please reduce your request rate.</Message></Error>"
                    )
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                host, port = proxy.upstream.split(":")
                connection = http.client.HTTPConnection(host, int(port), timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = proxy.upstream
                connection.request(self.command, self.path, body=body, headers=headers)
                answer = connection.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                # HEAD answers carry the object's length, not the (empty) body's.
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def file_url(path: Path) -> str:
    return f"file://{path}"
