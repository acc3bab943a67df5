"""A trainer-like process for the crash tests: publishes versions of the test model.

Puts slow down (``--slow-after``) once the given version starts uploading, so the
test can kill the process in the middle of that version's upload.

    python -m tests.weights_publisher_proc --url file:///tmp/s --first 0 --last 5
"""

from __future__ import annotations

import argparse
import time

from services.config import ObjectStoreConfig
from services.objectstore import ObjectInfo, ObjectStore, open_store
from services.objectstore.base import Bytes
from services.weights.publisher import WeightPublisher
from tests.test_weights import RUN, config, versions_of_a_model


class SlowStore(ObjectStore):
    """Delegates to a store; after the first object of `version` each put takes a while."""

    def __init__(self, inner: ObjectStore, version: int) -> None:
        self.inner, self.url, self.marker = inner, inner.url, f"/v{version:08d}/"

    def put(self, key: str, data: Bytes) -> ObjectInfo:
        info = self.inner.put(key, data)
        if self.marker in key:
            time.sleep(0.5)
        return info

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, keys: object) -> None:
        self.inner.delete(keys)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--last", type=int, required=True)
    parser.add_argument("--slow-after", type=int, default=-1)
    args = parser.parse_args()
    store = open_store(
        ObjectStoreConfig(url=args.url, endpoint_url=args.endpoint, region="us-east-1")
    )
    if args.slow_after >= 0:
        store = SlowStore(store, args.slow_after)
    # Small groups: a version is many objects, so there is a "middle" of its upload.
    publisher = WeightPublisher(store, RUN, config(group_bytes=2048))
    states = list(versions_of_a_model(args.last + 1))
    for version in range(args.first, args.last + 1):
        publisher.publish(states[version], version).result(timeout=120)
        print(f"published {version}", flush=True)
    publisher.close()


if __name__ == "__main__":
    main()
