"""Group state changes fanned out from Redis pub/sub to in-process watchers.

Pub/sub is best effort (a reconnect loses messages), so watchers also re-read the
states from Redis when nothing arrived for a while; an event is a hint that makes
the answer prompt, never the only way a state change is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.wire.retry import RetryPolicy, resume_stream

# Resubscribe 0.1 s after an outage, doubling to 5 s, for as long as it lasts; the
# confirmation of a new subscription starts the backoff over.
REDIS_RETRY = RetryPolicy(
    codes=frozenset(),
    errors=(RedisConnectionError, RedisTimeoutError, OSError),
    initial_backoff_s=0.1,
    max_backoff_s=5.0,
)


class GroupEvents:
    """Subscribes once to the run's event channel and routes events to watchers by group."""

    def __init__(self, client: aioredis.Redis, channel: str) -> None:
        self._redis = client
        self._channel = channel
        self._watchers: dict[str, set[asyncio.Queue[tuple[str, str]]]] = defaultdict(set)

    @contextlib.contextmanager
    def watch(self, group_ids: list[str]) -> Iterator[asyncio.Queue[tuple[str, str]]]:
        """A queue receiving (group_id, state) for the given groups while the block runs."""
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        for gid in group_ids:
            self._watchers[gid].add(queue)
        try:
            yield queue
        finally:
            for gid in group_ids:
                self._watchers[gid].discard(queue)
                if not self._watchers[gid]:
                    del self._watchers[gid]

    async def run(self) -> None:
        """Listens until cancelled, resubscribing after Redis outages (``REDIS_RETRY``)."""
        messages = resume_stream(self._messages, REDIS_RETRY, "group events subscription")
        async for message in messages:
            if message["type"] != "message":
                continue
            gid, _, state = message["data"].decode().partition(" ")
            for queue in self._watchers.get(gid, ()):
                queue.put_nowait((gid, state))

    async def _messages(self) -> AsyncIterator[dict[str, Any]]:
        """One subscription's messages, its subscribe confirmation first."""
        async with self._redis.pubsub() as pubsub:
            await pubsub.subscribe(self._channel)
            async for message in pubsub.listen():
                yield message
