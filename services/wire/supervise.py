"""Background tasks of a service (reapers, watchers, followers, publishers), supervised.

A loop meant to run as long as the process does is started with
``Supervisor.start(name, loop)``. When it raises (or returns), the supervisor logs
the crash with its traceback at once, marks the service not ready with the reason
(the readiness monitor of ``services.wire.server`` reads ``fault()``), and restarts
it after a backoff that doubles up to a ceiling. Once a restarted loop has run
``healthy_after_s`` without failing, the fault clears, readiness comes back and the
backoff starts over. Nothing a background loop does can end it silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Counter

log = logging.getLogger(__name__)

RESTARTS = Counter(
    "etude_background_restarts_total",
    "Background tasks restarted after they crashed or ended.",
    ["service", "task"],
)

Loop = Callable[[], Coroutine[Any, Any, None]]


class Supervisor:
    """Runs named background loops, restarting each with backoff, and reports faults."""

    def __init__(self, service: str) -> None:
        self._service = service
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._faults: dict[str, str] = {}

    def start(
        self,
        name: str,
        loop: Loop,
        *,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 5.0,
    ) -> None:
        """Runs `loop()` in the background under `name` until ``stop``."""
        if name in self._tasks:
            raise ValueError(f"a background task named {name!r} runs already")
        self._tasks[name] = asyncio.create_task(
            self._supervise(name, loop, initial_backoff_s, max_backoff_s, healthy_after_s),
            name=f"{self._service}:{name}",
        )

    def fault(self) -> str | None:
        """Why a background task is not running as it should (None when all are)."""
        return next(iter(self._faults.values()), None)

    @property
    def names(self) -> list[str]:
        """The names of the supervised tasks."""
        return list(self._tasks)

    async def _supervise(
        self, name: str, loop: Loop, initial_s: float, max_s: float, healthy_after_s: float
    ) -> None:
        backoff = initial_s
        while True:
            run: asyncio.Task[None] = asyncio.ensure_future(loop())
            try:
                done, _ = await asyncio.wait({run}, timeout=healthy_after_s)
                if not done:  # it runs: a later crash is a new fault, backoff from the start
                    backoff = initial_s
                    if self._faults.pop(name, None) is not None:
                        log.info("background task %s recovered", name)
                await run
                reason = "ended on its own"
                log.error("background task %s %s; restarting in %.1f s", name, reason, backoff)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                reason = f"crashed: {type(error).__name__}: {error}"[:500]
                log.error(
                    "background task %s crashed; restarting in %.1f s",
                    name,
                    backoff,
                    exc_info=error,
                )
            finally:
                if not run.done():
                    run.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await run
            self._faults[name] = f"background task {name} {reason}"
            RESTARTS.labels(self._service, name).inc()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_s)

    async def stop(self) -> None:
        """Cancels every task and waits for them to end."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
