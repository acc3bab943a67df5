"""Tagged checkpoints asked for over gRPC (SaveCheckpoint), saved between steps.

A request waits until the next step boundary. Rank 0 takes the tags asked for since the
last step and sends them with the step's messages; every rank saves them together
(checkpoints are collective), then rank 0 answers each request with the saved
checkpoint, or with the error every rank got (rank 0 decided it). Two requests for one
tag before a boundary get the same checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from services.trainer.checkpoint import CheckpointInfo

Save = Callable[[str], Awaitable[CheckpointInfo]]
"""Saves the checkpoint of a tag (on every rank)."""


class CheckpointRequests:
    """The requests waiting for a step boundary (rank 0's; empty on the others)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[str, asyncio.Future[CheckpointInfo]]] = asyncio.Queue()
        self._taken: dict[str, list[asyncio.Future[CheckpointInfo]]] = {}

    async def wait_for(self, tag: str) -> CheckpointInfo:
        """The checkpoint of ``tag``, once a step boundary has saved it."""
        future: asyncio.Future[CheckpointInfo] = asyncio.get_running_loop().create_future()
        await self._queue.put((tag, future))
        return await future

    def take(self) -> list[str]:
        """Rank 0: the tags requested since the last call, each once (their requests wait
        until ``save`` has saved them)."""
        tags = []
        while not self._queue.empty():
            tag, future = self._queue.get_nowait()
            self._taken.setdefault(tag, []).append(future)
            if tag not in tags:
                tags.append(tag)
        return tags

    async def save(self, tags: list[str], save: Save) -> None:
        """Saves each of ``tags`` (every rank, the tags rank 0 took); answers its requests."""
        for tag in tags:
            futures = self._taken.pop(tag, [])
            try:
                info = await save(tag)
            except Exception as error:  # the same on every rank: rank 0 decided
                for future in futures:
                    future.set_exception(error)
                continue
            for future in futures:
                future.set_result(info)

    async def answer_late(self, save: Save | None, refusal: str) -> None:
        """Requests that came in while the job was ending: saved with ``save`` (when the
        job can still save), or refused with ``refusal``."""
        while not self._queue.empty():
            tag, future = self._queue.get_nowait()
            if save is None:
                future.set_exception(RuntimeError(refusal))
                continue
            try:
                future.set_result(await save(tag))
            except Exception as error:
                future.set_exception(error)
