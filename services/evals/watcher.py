"""Following published versions: every N-th one is scored on the enabled suites.

Versions come from the reconciler's notices (``WatchPolicyVersions``) and, in case a
notice is lost, from polling the store's ``latest`` pointer. Evals run one version at a
time; a version published while one runs is not queued behind it: when the eval ends,
the newest version seen is next (the ones in between are skipped), so a slow eval
never makes the watcher fall further and further behind. A version scored on every
enabled suite by someone else (``RunEval``: ``etude run`` scores version 0 before
training starts) counts as scored: the stride runs from it, so version 1 is not scored
again right after version 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc import aio

from services.objectstore.base import ObjectStore, ObjectStoreError
from services.reconciler_client import ReconcilerClient
from services.weights.manifest import Layout, WeightsError, read_latest

log = logging.getLogger(__name__)

RETRY_S = 2.0


class VersionWatcher:
    """Calls `evaluate(version)` for each version at least `every` past the last one."""

    def __init__(
        self,
        *,
        reconciler: ReconcilerClient,
        store: ObjectStore,
        run: str,
        every: int,
        poll_interval_s: float,
        evaluate: Callable[[int], Awaitable[None]],
        last: int | None,
    ) -> None:
        self.reconciler = reconciler
        self.store = store
        self.layout = Layout(run)
        self.every = every
        self.poll_interval_s = poll_interval_s
        self.evaluate = evaluate
        self.last = last
        self.newest = last or 0
        self._changed = asyncio.Event()

    def offer(self, version: int) -> None:
        """A version is published (from any source; repeats are ignored)."""
        if version > self.newest:
            self.newest = version
            self._changed.set()

    def scored(self, version: int) -> None:
        """``version`` was scored on the enabled suites by another caller: the next one is
        due ``every`` past it (an older version changes nothing)."""
        if self.last is None or version > self.last:
            self.last = version

    def _due(self) -> bool:
        return self.newest > 0 and (self.last is None or self.newest >= self.last + self.every)

    async def run(self) -> None:
        """Evaluates due versions until cancelled."""
        sources = [asyncio.create_task(self._notices()), asyncio.create_task(self._poll())]
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                if not self._due():
                    continue
                version = self.newest
                await self.evaluate(version)
                self.last = version
                if self._due():
                    self._changed.set()
        finally:
            for source in sources:
                source.cancel()
            await asyncio.gather(*sources, return_exceptions=True)

    async def _notices(self) -> None:
        while True:
            try:
                async for version in self.reconciler.policy_versions(self.newest):
                    self.offer(version)
            except aio.AioRpcError as error:  # the client resumes outages itself; others too
                if error.code() == grpc.StatusCode.CANCELLED:
                    raise
                log.warning("version notices: %s; resuming", error.code().name)
                await asyncio.sleep(RETRY_S)

    async def _poll(self) -> None:
        while True:
            try:
                latest = await asyncio.to_thread(read_latest, self.store, self.layout)
            except (ObjectStoreError, WeightsError) as error:  # notices still work meanwhile
                log.warning("cannot read %s: %s", self.layout.latest, error)
            else:
                if latest is not None:
                    self.offer(latest)
            await asyncio.sleep(self.poll_interval_s)
