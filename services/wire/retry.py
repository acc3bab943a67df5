"""Riding out an outage of another service, where the channel's retry policy cannot.

Every channel (``services.wire.client.make_channel``) retries UNAVAILABLE with gRPC's
own ``retryPolicy`` from its service config: a few attempts with jittered backoff, which
covers blips (a reset connection, a pod replaced behind its Service). That policy cannot
wait out an outage, for three reasons gRPC gives it:

* gRPC clamps ``maxAttempts`` to 5, so its attempts last seconds, not the minutes a
  restarting replica or reconciler takes;
* all attempts share the call's one deadline, and DEADLINE_EXCEEDED is never retried;
* a streaming call is committed once its first response arrives: a Generate stream that
  breaks mid-way, or a watch that ends on its deadline, is never retried or reopened.

So the callers that must outlast an outage use the two helpers here, on top of the
channel's policy (each attempt below is itself retried by the channel):

* ``retrying(call, policy)`` runs a call again while it fails with one of
  ``policy.codes``, sleeping by the policy's backoff, until ``policy.deadline_s`` (never
  when None). ``call`` may read a whole stream (envs' Generate: a broken stream starts
  over and its tokens are dropped). The trainer's announcement of a policy version uses
  it too, with every code but FAILED_PRECONDITION (the reconciler has a newer version)
  as the outage.
* ``resume_stream(open_stream, policy)`` yields a watch's items and reopens it whenever
  it ends: at once on its deadline (watches outlive the channel's default deadline), after
  the backoff on an outage. ``open_stream`` builds the request from the caller's state,
  so a reopened watch resumes where the last one stopped. The reconciler's Redis
  subscription uses it too, with Redis's connection errors as the outage
  (``policy.errors``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from grpc import aio

log = logging.getLogger(__name__)

T = TypeVar("T")

_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED


@dataclass(frozen=True)
class RetryPolicy:
    """Which faults are an outage to wait out, how long to sleep between tries, and for
    how long in all. The backoff is deterministic (no jitter): ``initial_backoff_s``,
    multiplied by ``backoff_multiplier`` after each failure, at most ``max_backoff_s``."""

    codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    backoff_multiplier: float = 2.0
    deadline_s: float | None = None  # None: wait as long as the outage lasts
    # Exceptions other than gRPC's that mean an outage too (a Redis connection error).
    errors: tuple[type[Exception], ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"initial_backoff_s {self.initial_backoff_s} must be > 0 and <= "
                f"max_backoff_s {self.max_backoff_s}"
            )
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier {self.backoff_multiplier} must be >= 1")
        if self.deadline_s is not None and self.deadline_s < 0:
            raise ValueError(f"deadline_s {self.deadline_s} must be >= 0")

    def is_outage(self, error: BaseException) -> bool:
        """`error` is a fault this policy waits out."""
        if isinstance(error, aio.AioRpcError):
            return error.code() in self.codes
        return isinstance(error, self.errors)

    def backoff(self) -> Iterator[float]:
        """The sleeps between tries, in order."""
        delay = self.initial_backoff_s
        while True:
            yield delay
            delay = min(delay * self.backoff_multiplier, self.max_backoff_s)


def describe_error(error: BaseException) -> str:
    """A failure in one line: a gRPC error's code and details, else its type and text."""
    if isinstance(error, aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


async def retrying(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    what: str,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """``await call()``, tried again while it fails with an outage of ``policy``; the last
    error is raised once ``policy.deadline_s`` has passed, any other error at once.
    ``on_retry(error)`` is told of each failure that is tried again (a caller that reports
    the outage meanwhile: the trainer's readiness)."""
    deadline = None if policy.deadline_s is None else time.monotonic() + policy.deadline_s
    delays = policy.backoff()
    while True:
        try:
            return await call()
        except Exception as error:
            if not policy.is_outage(error):
                raise
            delay = next(delays)
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            log.warning("%s: %s; retrying in %.2f s", what, describe_error(error), delay)
            if on_retry is not None:
                on_retry(error)
            await asyncio.sleep(delay)


async def resume_stream(
    open_stream: Callable[[], AsyncIterable[T]], policy: RetryPolicy, what: str
) -> AsyncGenerator[T, None]:
    """The items of a stream that is reopened with ``open_stream()`` whenever it ends:
    at once when it ends normally or on DEADLINE_EXCEEDED (the stream outlived its
    deadline, which is no fault), after the policy's backoff on an outage (the backoff
    starts over once an item arrives). Other errors are raised, and so is an outage that
    outlasts ``policy.deadline_s``. Runs until the caller stops reading (close it with
    ``contextlib.aclosing``) or bounds it with ``asyncio.timeout``."""
    delays = policy.backoff()
    failing_since: float | None = None
    while True:
        stream = open_stream()
        try:
            async for item in stream:
                delays, failing_since = policy.backoff(), None
                yield item
        except Exception as error:
            if isinstance(error, aio.AioRpcError) and error.code() == _DEADLINE_EXCEEDED:
                continue
            if not policy.is_outage(error):
                raise
            now = time.monotonic()
            failing_since = now if failing_since is None else failing_since
            delay = next(delays)
            if policy.deadline_s is not None and now + delay - failing_since > policy.deadline_s:
                raise
            log.warning(
                "%s interrupted (%s); reopening in %.2f s", what, describe_error(error), delay
            )
            await asyncio.sleep(delay)
        finally:  # the caller stopped reading: end the call now rather than when collected
            if isinstance(stream, aio.Call):
                stream.cancel()
            elif isinstance(stream, AsyncGenerator):
                await stream.aclose()
