"""The version watcher: every N-th published version, the newest when behind.

Notices come from a queue standing in for the reconciler's version stream (the watcher
is under test, not the reconciler) and from a real file store's `latest` pointer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

from services.evals.watcher import VersionWatcher
from services.objectstore.local import FileObjectStore
from services.weights.manifest import Layout


class Notices:
    """What ReconcilerClient.policy_versions yields, fed by the test."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[int] = asyncio.Queue()

    async def policy_versions(self, after_version: int = 0) -> AsyncIterator[int]:
        while True:
            version = await self.queue.get()
            if version > after_version:
                yield version
            self.queue.task_done()  # after the watcher took it


async def test_watcher_skips_to_the_newest_and_keeps_its_stride(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "store")
    notices = Notices()
    evaluated: asyncio.Queue[int] = asyncio.Queue()
    release = asyncio.Event()

    async def evaluate(version: int) -> None:
        await evaluated.put(version)
        await release.wait()

    watcher = VersionWatcher(
        reconciler=notices,  # type: ignore[arg-type]
        store=store,
        run="r",
        every=2,
        poll_interval_s=0.05,
        evaluate=evaluate,
        last=None,
    )
    running = asyncio.create_task(watcher.run())
    try:
        async with asyncio.timeout(10):
            await notices.queue.put(1)
            assert await evaluated.get() == 1
            for version in (2, 3, 4, 5):  # published while version 1 is being scored
                await notices.queue.put(version)
            await notices.queue.join()
            release.set()
            assert await evaluated.get() == 5  # 2, 3 and 4 are skipped
            await notices.queue.put(6)  # only one past 5: not due
            await notices.queue.join()
            # A notice lost: the store's latest pointer still brings version 7.
            store.put(Layout("r").latest, json.dumps({"version": 7}).encode())
            assert await evaluated.get() == 7
        assert evaluated.empty()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_a_version_scored_by_another_caller_starts_the_stride(tmp_path: Path) -> None:
    """`etude run` scores version 0 through RunEval before training: with a stride of 3
    the watcher then scores version 3, not version 1 right after it."""
    notices = Notices()
    evaluated: asyncio.Queue[int] = asyncio.Queue()

    async def evaluate(version: int) -> None:
        await evaluated.put(version)

    watcher = VersionWatcher(
        reconciler=notices,  # type: ignore[arg-type]
        store=FileObjectStore(tmp_path / "store"),
        run="r",
        every=3,
        poll_interval_s=0.05,
        evaluate=evaluate,
        last=None,
    )
    watcher.scored(0)
    running = asyncio.create_task(watcher.run())
    try:
        async with asyncio.timeout(10):
            for version in (1, 2):
                await notices.queue.put(version)
            await notices.queue.join()
            await asyncio.sleep(0.2)  # two polls of the (empty) store: nothing is due
            assert evaluated.empty()
            await notices.queue.put(3)
            assert await evaluated.get() == 3
            watcher.scored(5)  # scored elsewhere meanwhile: 6 and 7 are not due, 8 is
            for version in (6, 7, 8):
                await notices.queue.put(version)
            assert await evaluated.get() == 8
            watcher.scored(2)  # an older version changes nothing
            assert watcher.last == 8
        assert evaluated.empty()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
