"""Keeping a replica on the newest published policy version.

The follower learns of versions from the reconciler's notices and from polling the
store's ``latest`` pointer, reconstructs a version with the weights subscriber (in a
thread: generation goes on meanwhile), then has the engine pause with requests kept,
load, relabel and resume. A replica that fell far behind simply asks for the newest
version: the subscriber walks its delta chain down to a keyframe. A version that
fails to load is logged and counted; the replica keeps serving what it has. Any other
failure ends ``run``: the service runs it under its supervisor
(``services.wire.supervise``), which logs it, turns readiness off with the reason and
runs the follower again, subscribed from the version it serves then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from services.inference import metrics
from services.inference.engine import Engine
from services.objectstore.base import ObjectStoreError
from services.weights.codec import CodecError
from services.weights.manifest import WeightsError, read_manifest
from services.weights.subscriber import WeightSubscriber

log = logging.getLogger(__name__)


class WeightFollower:
    """Moves the engine to each newer version, one at a time, newest first."""

    def __init__(self, engine: Engine, subscriber: WeightSubscriber) -> None:
        self.engine = engine
        self.subscriber = subscriber
        self._requested: asyncio.Queue[int] = asyncio.Queue()
        # The newest version any source asked for: a follower run again after a crash
        # asks for it first, in case the crash lost it.
        self._newest_wanted = -1
        self._loading = asyncio.Lock()  # one load at a time, across runs of the follower
        self.last_pause_s = 0.0
        self.last_error = ""

    def is_published(self, version: int) -> bool:
        """True when `version` has a manifest (it is complete)."""
        try:
            read_manifest(self.subscriber.store, self.subscriber.layout, version)
        except WeightsError:
            return False
        return True

    def request(self, version: int) -> None:
        """Asks for `version` (a notice arrived by RPC)."""
        log.info("version %d asked for by RPC", version)
        self._requested.put_nowait(version)

    async def catch_up(self) -> None:
        """Loads the newest complete version if it is newer than what is served."""
        latest = await asyncio.to_thread(self.subscriber.latest)
        if latest is not None and latest > self.engine.serving_version:
            await self.update_to(latest)

    async def wait_idle(self) -> None:
        """Returns once no load is in progress (a stopping service waits for one)."""
        async with self._loading:
            pass

    async def update_to(self, version: int) -> bool:
        """Loads `version` into the engine; False (logged, counted) when it cannot."""
        async with self._loading:
            return await self._load(version)

    async def _load(self, version: int) -> bool:
        if version <= self.engine.serving_version:
            return True
        started = time.perf_counter()
        log.info("loading version %d (serving %d)", version, self.engine.serving_version)
        try:
            tensors = await asyncio.to_thread(self.subscriber.load, version)
            fetched_s = time.perf_counter() - started
            manifest = await asyncio.to_thread(
                read_manifest, self.subscriber.store, self.subscriber.layout, version
            )
            pause_s = await self.engine.apply_weights(tensors, version)
        except (WeightsError, CodecError, ObjectStoreError) as error:
            reason = type(error).__name__
            metrics.UPDATE_FAILURES.labels(reason).inc()
            self.last_error = f"version {version}: {error}"
            log.error(
                "cannot load version %d, still serving %d: %s",
                version,
                self.engine.serving_version,
                error,
            )
            return False
        self.last_pause_s = pause_s
        metrics.UPDATE_PAUSE.observe(pause_s)
        metrics.UPDATE_LAG.observe(max(0.0, time.time() - manifest.created_at))
        metrics.SERVING_VERSION.set(version)
        log.info(
            "serving version %d (fetched in %.2f s, serving %.2f s after loading began, "
            "generation paused %.3f s)",
            version,
            fetched_s,
            time.perf_counter() - started,
            pause_s,
        )
        return True

    async def run(self, notices: AsyncIterator[int] | None) -> None:
        """Follows versions until cancelled: notices, RPC requests, polling ``latest``.

        Raises when any part fails (the notice stream, a ``latest`` pointer that cannot
        be read, an error loading a version other than the version's own faults), so the
        service's supervisor logs it, reports it and runs the follower again; the newest
        version asked for and not yet served is asked for again then, so none is lost.
        """
        wanted: asyncio.Queue[int] = asyncio.Queue()
        if self._newest_wanted > self.engine.serving_version:
            wanted.put_nowait(self._newest_wanted)

        async def feed(source: AsyncIterator[int]) -> None:
            async for version in source:
                self._newest_wanted = max(self._newest_wanted, version)
                wanted.put_nowait(version)

        async def apply() -> None:
            while True:
                version = await wanted.get()
                while not wanted.empty():  # skip to the newest asked for
                    version = max(version, wanted.get_nowait())
                # A load runs to its end even when this run is cancelled: cut half-way,
                # the engine could hold the new weights under the old version's label.
                await asyncio.shield(self.update_to(version))

        async def requested() -> AsyncIterator[int]:
            while True:
                yield await self._requested.get()

        parts = {
            "polling": feed(self.subscriber.follow(after=self.engine.serving_version)),
            "version requests": feed(requested()),
            "loading": apply(),
        }
        if notices is not None:
            parts["version notices"] = feed(notices)
        tasks = [asyncio.create_task(part, name=name) for name, part in parts.items()]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the part's error
            raise RuntimeError(f"the follower's {', '.join(t.get_name() for t in done)} ended")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
