"""Followers under supervision (issue 33, deliverable 5): an inference replica whose weight
follower breaks on a real fault turns NOT_SERVING with the reason, runs the follower
again, and recovers without losing the version it was following.

The replica is the real inference service run in process, with its real follower,
weights subscriber, file store and a real reconciler process for the notices; only vLLM
is left out: its engine loads the weights into a dict (vLLM's part of an update is tested
in tests/test_inference.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api.v1 import common_pb2, inference_pb2_grpc
from services.config import WeightsConfig
from services.config.deployment import load_config
from services.inference.service import InferenceService
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.weights.manifest import Layout
from services.weights.publisher import WeightPublisher
from services.wire.client import Channels, make_channel
from services.wire.ports import free_port
from services.wire.server import serve
from tests.conftest import TOKEN
from tests.reconciler_support import ReconcilerProcess, reconciler

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DictEngine:
    """The replica's engine without vLLM: a weight update replaces a dict of tensors."""

    capture_mode = "off"
    num_in_flight = 0
    max_model_len = 64
    vocab_size = 16

    def __init__(self) -> None:
        self.serving_version = 0
        self.loaded = False
        self.weights: dict[str, torch.Tensor] = {}

    async def start(self) -> None:
        self.loaded = True

    async def stop(self) -> None:
        self.loaded = False

    async def apply_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> float:
        self.weights, self.serving_version = dict(tensors), version
        return 0.0


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.full((4, 4), float(version), dtype=torch.bfloat16)}


@dataclass
class Replica:
    target: str
    service: InferenceService
    engine: DictEngine
    store: FileObjectStore
    publisher: WeightPublisher
    reconciler: ReconcilerProcess

    def publish(self, version: int) -> common_pb2.PolicyVersionNotice:
        """Writes `version` to the store as the trainer does; returns its notice."""
        self.publisher.publish(weights(version), version).result(timeout=30)
        return common_pb2.PolicyVersionNotice(
            version=version, manifest_key=Layout(self.reconciler.run_name).manifest(version)
        )

    async def announce(self, notice: common_pb2.PolicyVersionNotice) -> None:
        async with make_channel(self.reconciler.target, token=TOKEN) as channel:
            await ReconcilerClient(channel).publish_version(notice)

    async def readiness(self) -> int:
        async with aio.insecure_channel(self.target) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=2
            )
        return int(answer.status)

    async def wait_readiness(self, status: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while await self.readiness() != status:
            assert time.monotonic() < deadline, (
                f"readiness never became {status}: {self.service.readiness}"
            )
            await asyncio.sleep(0.1)


async def start_replica(tmp_path: Path, poll_interval_s: float) -> AsyncIterator[Replica]:
    store = FileObjectStore(tmp_path / "store")
    with reconciler(tmp_path) as control:
        publisher = WeightPublisher(store, control.run_name, WeightsConfig(collect_garbage=False))
        port = free_port()
        config = load_config(
            None,
            {
                "ETUDE_AUTH__TOKEN": TOKEN,
                "ETUDE_RUN__NAME": control.run_name,
                "ETUDE_ENDPOINTS__RECONCILER": control.target,
                "ETUDE_OBJECT_STORE__URL": f"file://{store.root}",
                "ETUDE_WEIGHTS__POLL_INTERVAL_S": str(poll_interval_s),
                "ETUDE_INFERENCE__FOLLOW_WEIGHTS": "true",
                "ETUDE_INFERENCE__READINESS_INTERVAL_S": "0.2",
                "ETUDE_INFERENCE__GRPC__HOST": "127.0.0.1",
                "ETUDE_INFERENCE__GRPC__PORT": str(port),
                "ETUDE_INFERENCE__HTTP__PORT": "0",
            },
        )
        engine = DictEngine()
        service = InferenceService(config, Channels(config), engine=engine)  # type: ignore[arg-type]
        replica = Replica(f"127.0.0.1:{port}", service, engine, store, publisher, control)
        await asyncio.to_thread(replica.publish, 1)  # out before the replica starts
        stop = asyncio.Event()
        serving = asyncio.create_task(serve(service, stop=stop))
        try:
            await replica.wait_readiness(SERVING, 30)
            assert engine.serving_version == 1
            yield replica
        finally:
            stop.set()
            await serving
            publisher.close()


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[Replica]:
    """Updates come from notices only: polling is too slow to matter in a test."""
    async for started in start_replica(tmp_path, poll_interval_s=600):
        yield started


@pytest.fixture
async def polling_replica(tmp_path: Path) -> AsyncIterator[Replica]:
    """Polls `latest` every 0.2 s."""
    async for started in start_replica(tmp_path, poll_interval_s=0.2):
        yield started


async def test_a_broken_follower_turns_readiness_off_and_resumes_from_its_version(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    """A version's manifest the store cannot read (a directory where the file should be:
    IsADirectoryError, not a fault of the version) used to end the follower's task
    silently, with readiness SERVING and the replica on its old weights for good."""
    caplog.set_level(logging.INFO, logger="services.wire.supervise")
    notice = await asyncio.to_thread(replica.publish, 2)
    manifest = replica.store.root / notice.manifest_key
    aside = manifest.with_name("manifest.json.aside")
    manifest.rename(aside)
    manifest.mkdir()
    await replica.announce(notice)  # the only way the replica learns of version 2

    await replica.wait_readiness(NOT_SERVING, 10)
    detail = replica.service.readiness.detail
    assert detail.startswith("background task weight-follower crashed: IsADirectoryError"), detail
    crashes = [r for r in caplog.records if "weight-follower crashed" in r.getMessage()]
    assert crashes and crashes[0].exc_info is not None  # logged at once, with its traceback
    assert replica.engine.serving_version == 1

    manifest.rmdir()
    aside.rename(manifest)
    # Run again, the follower subscribes after version 1 and gets the notice of version 2.
    await replica.wait_readiness(SERVING, 30)
    assert replica.engine.serving_version == 2
    assert torch.equal(replica.engine.weights["layer.weight"], weights(2)["layer.weight"])
    assert any("weight-follower recovered" in r.getMessage() for r in caplog.records)

    # Followed as before: the next notice is loaded at once.
    await replica.announce(await asyncio.to_thread(replica.publish, 3))
    deadline = time.monotonic() + 10
    while replica.engine.serving_version != 3:
        assert time.monotonic() < deadline, "version 3 was never loaded"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_an_unreadable_latest_pointer_is_a_fault_until_repaired(
    polling_replica: Replica,
) -> None:
    """A `latest` pointer that does not parse used to end the follower's polling (and its
    notices with it) silently."""
    replica = polling_replica
    latest = replica.store.root / Layout(replica.reconciler.run_name).latest
    good = latest.read_bytes()
    latest.write_bytes(b"{not json")
    await replica.wait_readiness(NOT_SERVING, 10)
    detail = replica.service.readiness.detail
    assert "weight-follower crashed: WeightsError" in detail and "latest" in detail, detail
    latest.write_bytes(good)
    await replica.wait_readiness(SERVING, 30)
    await asyncio.to_thread(replica.publish, 2)  # polling finds it, no notice sent
    deadline = time.monotonic() + 10
    while replica.engine.serving_version != 2:
        assert time.monotonic() < deadline, "version 2 was never loaded"
        await asyncio.sleep(0.1)


async def test_notify_version_checks_the_manifest_key(replica: Replica) -> None:
    """Deliverable 4: NotifyVersion carries an object key; it is checked where it enters,
    with the one key check (``services.messages.require_object_key``)."""
    async with make_channel(replica.target, token=TOKEN) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for key in ["../../x", "a//b", "", "/etc/passwd", "a/./b", "a\x00b", "k" * 2000]:
            notice = common_pb2.PolicyVersionNotice(version=2, manifest_key=key)
            with pytest.raises(aio.AioRpcError) as refused:
                await stub.NotifyVersion(notice)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, key
            assert refused.value.details().startswith("manifest_key: "), refused.value.details()
        layout = Layout(replica.reconciler.run_name)
        zero = common_pb2.PolicyVersionNotice(version=0, manifest_key=layout.manifest(0))
        with pytest.raises(aio.AioRpcError) as refused:
            await stub.NotifyVersion(zero)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("version: "), refused.value.details()
        # A well-formed notice of a version that is not in the store: NOT_FOUND, as before.
        unpublished = common_pb2.PolicyVersionNotice(version=99, manifest_key=layout.manifest(99))
        with pytest.raises(aio.AioRpcError) as missing:
            await stub.NotifyVersion(unpublished)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND, missing.value.details()
        served = common_pb2.PolicyVersionNotice(version=1, manifest_key=layout.manifest(1))
        answer = await stub.NotifyVersion(served)
        assert answer.accepted and answer.serving_version == 1
