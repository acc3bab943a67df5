"""The trainer's publishers (issue 33, deliverable 5): a version that cannot be uploaded
or announced is logged at once, reported as the trainer's readiness fault (``fault()``),
tried again (a notice with backoff; an upload by the next version, which supersedes it)
and cleared when it gets through. Nothing ends silently.

The publisher is the trainer's own (``PolicyPublisher`` over the real ``WeightPublisher``,
a file store and a real reconciler process), its loop run under the supervisor the job
uses; the runtime is the single-process one, serving a dict of tensors instead of a
model's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.api.v1 import common_pb2
from services.config import WeightsConfig
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.trainer.publishing import PolicyPublisher
from services.trainer.runtime import LocalRuntime
from services.weights.manifest import Layout, read_latest
from services.weights.subscriber import WeightSubscriber
from services.wire.client import make_channel
from services.wire.supervise import Supervisor
from tests.conftest import TOKEN
from tests.reconciler_support import reconciler

pytestmark = pytest.mark.integration


class DictRuntime(LocalRuntime):
    """One process that serves the dict of tensors it is given as its model's weights."""

    def served_weights(self, model: Any) -> dict[str, torch.Tensor]:
        return dict(model)


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.full((4, 4), float(version), dtype=torch.bfloat16)}


@contextlib.asynccontextmanager
async def running(publisher: PolicyPublisher) -> AsyncIterator[Supervisor]:
    """The publisher's loop under a supervisor, as the training job runs it."""
    background = Supervisor("trainer")
    background.start("publisher", publisher.run, initial_backoff_s=0.1, healthy_after_s=0.5)
    try:
        yield background
    finally:
        await background.stop()
        publisher.close()


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_notice_the_reconciler_cannot_take_is_retried_until_it_does(
    tmp_path: Path,
) -> None:
    """The announcement used to be tried once: with the reconciler down for a moment,
    the version was never announced (evals follow notices only) and nothing said so."""
    store = FileObjectStore(tmp_path / "store")
    with reconciler(tmp_path) as control:
        async with make_channel(control.target, token=TOKEN, default_timeout_s=5) as channel:
            client = ReconcilerClient(channel)
            config = WeightsConfig(collect_garbage=False)
            publisher = PolicyPublisher(store, control.run_name, config, client, DictRuntime())
            async with running(publisher):
                control.stop()
                assert await publisher.publish(weights(1), 1)  # type: ignore[arg-type]
                await wait_until(lambda: publisher.fault() is not None, 30, "no fault reported")
                fault = publisher.fault()
                assert fault is not None
                assert fault.startswith("could not announce version 1 to the reconciler: "), fault
                assert publisher.last_published_version == 1  # uploaded; only the notice waits
                await asyncio.to_thread(control.start)
                await asyncio.wait_for(publisher.drain(), 60)
                assert publisher.fault() is None and publisher.last_announced_version == 1
                status = await client.stub.GetStatus(common_pb2.StatusRequest())
                assert status.current_policy_version == 1


async def test_a_version_not_uploaded_is_a_fault_until_a_later_one_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An upload that failed was a log line without a traceback and nothing else."""
    caplog.set_level(logging.ERROR, logger="services.trainer.publishing")
    store = FileObjectStore(tmp_path / "store")
    layout = Layout("upload-faults")
    config = WeightsConfig(collect_garbage=False, publish_attempts=2)
    publisher = PolicyPublisher(store, layout.run, config, None, DictRuntime())
    async with running(publisher):
        assert await publisher.publish(weights(1), 1)  # type: ignore[arg-type]
        await publisher.drain()
        assert publisher.fault() is None
        # A file where version 2's directory goes: every put under it is an OSError.
        blocker = store.root / layout.version_dir(2)
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_bytes(b"")
        assert await publisher.publish(weights(2), 2)  # type: ignore[arg-type]
        await publisher.drain()
        fault = publisher.fault()
        assert fault is not None and fault.startswith("version 2 was not published: "), fault
        (record,) = [r for r in caplog.records if "version 2 was not published" in r.getMessage()]
        assert record.exc_info is not None  # logged at once, with its traceback
        assert publisher.failures == 1

        blocker.unlink()
        assert await publisher.publish(weights(3), 3)  # type: ignore[arg-type]
        await publisher.drain()
        assert publisher.fault() is None and publisher.last_published_version == 3
        assert read_latest(store, layout) == 3
        loaded = WeightSubscriber(store, layout.run, config).load(3)
        assert torch.equal(loaded["layer.weight"], weights(3)["layer.weight"])


class FlakyReconciler(ReconcilerClient):
    """A reconciler client whose first announcement fails in a way nobody expected."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls = 0

    async def publish_version(self, notice: common_pb2.PolicyVersionNotice) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug in the announcement")
        return await super().publish_version(notice)


async def test_a_crash_of_the_publishing_loop_is_reported_and_loses_no_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Announcements were tasks of their own: a bug in one ended it, with no restart."""
    caplog.set_level(logging.ERROR, logger="services.wire.supervise")
    store = FileObjectStore(tmp_path / "store")
    with reconciler(tmp_path) as control:
        async with make_channel(control.target, token=TOKEN, default_timeout_s=5) as channel:
            client = FlakyReconciler(channel)
            config = WeightsConfig(collect_garbage=False)
            publisher = PolicyPublisher(store, control.run_name, config, client, DictRuntime())
            async with running(publisher) as background:
                assert await publisher.publish(weights(1), 1)  # type: ignore[arg-type]
                await wait_until(lambda: background.fault() is not None, 30, "no fault")
                fault = background.fault()
                assert fault is not None and "RuntimeError: a bug in the announcement" in fault
                (record,) = [r for r in caplog.records if "publisher crashed" in r.getMessage()]
                assert record.exc_info is not None  # logged at once, with its traceback
                # Restarted, it settles the version it was settling: announced once.
                await asyncio.wait_for(publisher.drain(), 60)
                assert publisher.last_announced_version == 1 and client.calls == 2
                status = await client.stub.GetStatus(common_pb2.StatusRequest())
                assert status.current_policy_version == 1
                await wait_until(lambda: background.fault() is None, 30, "fault not cleared")
