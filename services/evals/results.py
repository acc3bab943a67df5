"""Where eval results live: JSON in the object store, and nowhere else.

    evals/<run>/<suite>/v<version>.json     one EvalRecord per (suite, version)
    evals/<run>/report/index.html, *.png, results.json    the latest report

A result's key follows from its suite and version, so reading one is a single GET, and
``discover`` lists what exists (the report CLI works from the same listing). Only the
reconciler talks to Redis.
"""

from __future__ import annotations

import asyncio
import re

from services.api.v1 import common_pb2
from services.evals.record import EvalRecord
from services.objectstore.base import ObjectInfo, ObjectNotFound, ObjectStore, sha256_hex

_RESULT_KEY = re.compile(r"^(?P<suite>[^/]+)/v(?P<version>\d+)\.json$")


def _text(value: bytes | str) -> str:
    return value if isinstance(value, str) else value.decode()


def result_key(run: str, suite: str, version: int) -> str:
    """Object key of the result of `suite` on `version`."""
    return f"evals/{run}/{suite}/v{version}.json"


def report_prefix(run: str) -> str:
    """Where the service keeps the latest report of `run`."""
    return f"evals/{run}/report/"


def object_ref(key: str, data: bytes) -> common_pb2.ObjectRef:
    """The ObjectRef of `data` stored at `key`."""
    return common_pb2.ObjectRef(key=key, size_bytes=len(data), sha256=sha256_hex(data))


def discover(store: ObjectStore, run: str) -> dict[str, dict[int, str]]:
    """{suite: {version: key}} of every result of `run` in the store."""
    prefix = f"evals/{run}/"
    found: dict[str, dict[int, str]] = {}
    for key in store.list(prefix):
        match = _RESULT_KEY.match(key[len(prefix) :])
        if match:
            found.setdefault(match["suite"], {})[int(match["version"])] = key
    return found


def read_record(store: ObjectStore, key: str) -> tuple[EvalRecord, common_pb2.ObjectRef]:
    """The record stored at `key` and its reference."""
    data = store.get(key)
    return EvalRecord.model_validate_json(data), object_ref(key, data)


class ResultsStore:
    """A run's eval results in the object store."""

    def __init__(self, store: ObjectStore, run: str) -> None:
        self.store = store
        self.run = run

    async def save(self, record: EvalRecord) -> ObjectInfo:
        """Stores the record (replacing one of the same suite and version)."""
        key = result_key(self.run, record.suite, record.policy_version)
        data = record.model_dump_json(indent=2).encode()
        return await asyncio.to_thread(self.store.put, key, data)

    async def all_versions(self) -> dict[str, dict[int, str]]:
        """{suite: {version: key}} of every stored result, from one listing."""
        return await asyncio.to_thread(discover, self.store, self.run)

    async def versions(self, suite: str) -> dict[int, str]:
        """{version: key} of `suite`'s stored results."""
        return (await self.all_versions()).get(suite, {})

    async def load(
        self, suite: str, version: int
    ) -> tuple[EvalRecord, common_pb2.ObjectRef] | None:
        """The result of `suite` on `version`, or None when there is none."""
        try:
            return await asyncio.to_thread(
                read_record, self.store, result_key(self.run, suite, version)
            )
        except ObjectNotFound:
            return None

    async def put_report(self, files: dict[str, bytes]) -> dict[str, common_pb2.ObjectRef]:
        """Stores the report's files under the run's report prefix."""
        prefix = report_prefix(self.run)
        refs = {}
        for name, data in sorted(files.items()):
            info = await asyncio.to_thread(self.store.put, prefix + name, data)
            refs[name] = common_pb2.ObjectRef(
                key=info.key, size_bytes=info.size, sha256=info.sha256
            )
        return refs

    def report_file(self, name: str) -> bytes:
        """One file of the latest report (blocking); ObjectNotFound when absent."""
        return self.store.get(report_prefix(self.run) + name)
