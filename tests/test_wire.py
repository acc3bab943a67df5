"""The shared server plumbing, in process: auth, error mapping, metrics, deadlines,
trace propagation across two real aio servers (in-memory span exporter)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.api.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.config.deployment import load_config
from services.trainer.service import TrainerService
from services.wire import ports as ports_module
from services.wire.client import make_channel
from services.wire.errors import InvalidArgument, NotFound
from services.wire.interceptors import HANDED_BACK
from services.wire.ports import ephemeral_start, free_port, free_ports, service_ports
from services.wire.server import build_server, make_service, serve
from services.wire.service import Readiness, Service

TOKEN = "in-process-token"


class _Faulty(trainer_pb2_grpc.TrainerServiceServicer):
    """Each method fails in a different way, to check the mapping."""

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> None:
        raise NotFound("no such run 'x'")

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: aio.ServicerContext
    ) -> None:
        raise InvalidArgument("tag", "is wrong")

    async def ListCheckpoints(
        self, request: trainer_pb2.ListCheckpointsRequest, context: aio.ServicerContext
    ) -> None:
        raise ZeroDivisionError("a bug")


class _FaultyService(Service):
    name = "trainer"

    def register(self, server: aio.Server) -> list[str]:
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(_Faulty(), server)
        return ["etude.v1.TrainerService"]


def _config(port: int, **extra: str):  # type: ignore[no-untyped-def]
    return load_config(
        None,
        {
            "ETUDE_AUTH__TOKEN": TOKEN,
            "ETUDE_TRAINER__GRPC__HOST": "127.0.0.1",
            "ETUDE_TRAINER__GRPC__PORT": str(port),
            "ETUDE_TRAINER__HTTP__PORT": "0",
            **extra,
        },
    )


@pytest.fixture
async def faulty() -> AsyncIterator[str]:
    port = free_port()
    server = build_server(make_service(_FaultyService, _config(port)), None).server
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def _counted(method: str, code: str, expected: float) -> float:
    """The counter once it reaches `expected` (the server counts just after answering)."""
    for _ in range(200):
        value = _counter(method, code)
        if value >= expected:
            return value
        await asyncio.sleep(0.01)
    return _counter(method, code)


def _counter(method: str, code: str) -> float:
    value = REGISTRY.get_sample_value(
        "grpc_server_handled_total",
        {
            "grpc_service": "etude.v1.TrainerService",
            "grpc_method": method,
            "grpc_type": "unary",
            "grpc_code": code,
        },
    )
    return value or 0.0


async def test_service_errors_map_to_status_codes(faulty: str) -> None:
    before = _counter("SaveCheckpoint", "INVALID_ARGUMENT"), _counter("ListCheckpoints", "INTERNAL")
    async with make_channel(faulty, token=TOKEN) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        with pytest.raises(aio.AioRpcError) as not_found:
            await stub.GetStatus(common_pb2.StatusRequest())
        with pytest.raises(aio.AioRpcError) as invalid:
            await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(tag="x"))
        with pytest.raises(aio.AioRpcError) as internal:
            await stub.ListCheckpoints(trainer_pb2.ListCheckpointsRequest())
    assert (not_found.value.code(), not_found.value.details()) == (
        grpc.StatusCode.NOT_FOUND,
        "no such run 'x'",
    )
    assert (invalid.value.code(), invalid.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "tag: is wrong",
    )
    assert internal.value.code() == grpc.StatusCode.INTERNAL
    assert "a bug" not in internal.value.details()  # internals stay in the server log
    after = (
        await _counted("SaveCheckpoint", "INVALID_ARGUMENT", before[0] + 1),
        await _counted("ListCheckpoints", "INTERNAL", before[1] + 1),
    )
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


async def test_auth_rejects_before_the_servicer_runs(faulty: str) -> None:
    before = _counter("SaveCheckpoint", "UNAUTHENTICATED")
    async with make_channel(faulty, token="wrong") as channel:
        with pytest.raises(aio.AioRpcError) as denied:
            await trainer_pb2_grpc.TrainerServiceStub(channel).SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(tag="x")
            )
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert denied.value.details() == "invalid bearer token"
    assert await _counted("SaveCheckpoint", "UNAUTHENTICATED", before + 1) - before == 1


async def test_server_refuses_to_start_without_a_token() -> None:
    config = load_config(None, {"ETUDE_TRAINER__GRPC__PORT": str(free_port())})
    with pytest.raises(ValueError, match="ETUDE_AUTH__TOKEN"):
        build_server(make_service(TrainerService, config), None)


async def test_default_deadline_applies_to_calls_without_one() -> None:
    """A server that never answers: the client's default deadline ends the call."""
    port = free_port()
    server = aio.server()
    server.add_insecure_port(f"127.0.0.1:{port}")

    class _Slow(trainer_pb2_grpc.TrainerServiceServicer):
        async def GetStatus(
            self, request: common_pb2.StatusRequest, context: aio.ServicerContext
        ) -> None:
            import asyncio

            await asyncio.sleep(30)

    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(_Slow(), server)
    await server.start()
    try:
        async with make_channel(f"127.0.0.1:{port}", token=None, default_timeout_s=0.3) as channel:
            with pytest.raises(aio.AioRpcError) as late:
                await trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(
                    common_pb2.StatusRequest()
                )
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await server.stop(0)


async def test_trace_propagates_between_two_in_process_servers() -> None:
    """evals-like caller -> trainer GetStatus(include_dependencies) -> reconciler health."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    upstream_port, downstream_port = free_ports(2)
    # The downstream: a real TrainerService server standing in as "reconciler" for the upstream.
    downstream_config = _config(downstream_port)
    downstream = make_service(TrainerService, downstream_config, provider)
    downstream_server, downstream_health, _, _ = build_server(downstream, provider)
    upstream_config = _config(
        upstream_port, ETUDE_ENDPOINTS__RECONCILER=f"127.0.0.1:{downstream_port}"
    )
    upstream = make_service(TrainerService, upstream_config, provider)
    upstream_server = build_server(upstream, provider).server
    await downstream_server.start()
    await upstream_server.start()
    await downstream_health.set("readiness", 1)  # SERVING
    try:
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("root") as root:
            async with make_channel(
                f"127.0.0.1:{upstream_port}", token=TOKEN, tracer_provider=provider
            ) as ch:
                status = await trainer_pb2_grpc.TrainerServiceStub(ch).GetStatus(
                    common_pb2.StatusRequest(include_dependencies=True)
                )
    finally:
        await upstream_server.stop(0)
        await downstream_server.stop(0)
        await upstream.channels.close()
    assert [(d.name, d.ready) for d in status.info.dependencies] == [("reconciler", True)]
    spans = [
        s
        for s in exporter.get_finished_spans()
        if s.context.trace_id == root.get_span_context().trace_id
    ]
    by_id = {s.context.span_id: s for s in spans}
    health_server = next(
        s for s in spans if s.name.endswith("Health/Check") and s.kind.name == "SERVER"
    )
    chain = []
    span = health_server
    while span is not None:
        chain.append((span.name, span.kind.name))
        span = by_id.get(span.parent.span_id) if span.parent else None
    assert [kind for _, kind in chain] == ["SERVER", "CLIENT", "SERVER", "CLIENT", "INTERNAL"]
    assert chain[-1][0] == "root"


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    pairs = service_ports(["a", "b", "c"])
    assert list(pairs) == ["a", "b", "c"]
    assert len({port for pair in pairs.values() for port in pair}) == 6
    for port in ports:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))


def test_free_ports_stay_out_of_the_range_outgoing_connections_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A port in the ephemeral range can be taken by any connect() before the service
    # binds it (a torchrun restart lost its HTTP port to one that way).
    assert all(20_000 <= port < min(ephemeral_start(), 32_768) for port in free_ports(32))
    monkeypatch.setattr(ports_module, "ephemeral_start", lambda: 20_003)  # 3 candidates
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 20_001))
        assert sorted(free_ports(2)) == [20_000, 20_002]  # a port in use is skipped
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("24000\t60999\n")
    assert ephemeral_start(range_file) == 24_000
    assert ephemeral_start(tmp_path / "missing") == 32_768
    monkeypatch.setattr(ports_module, "ephemeral_start", lambda: 20_000)  # no room below
    assert len(set(free_ports(4))) == 4  # the kernel picks


def test_requests_are_checked_from_their_descriptors() -> None:
    """Unknown enums, non-finite floats and inexact 64-bit integers, named by path."""
    import math

    from services.api.v1 import reconciler_pb2
    from services.wire.requests import MAX_EXACT_INT, check_message

    def problem(message: object) -> str:
        with pytest.raises(InvalidArgument) as error:
            check_message(message)  # type: ignore[arg-type]
        return str(error.value)

    summary = common_pb2.RolloutSummary(
        reward=common_pb2.RewardParts(behaviour_parts={"todo": math.nan})
    )
    complete = reconciler_pb2.CompleteSlotRequest(rollout=summary)
    assert problem(complete).startswith("rollout.reward.behaviour_parts['todo']: must be a finite")
    claim = reconciler_pb2.ClaimSlotsRequest(kinds=[1, 7])
    assert problem(claim).startswith("kinds[1]: 7 is not a SlotKind")
    pull = reconciler_pb2.PullBatchRequest(step=MAX_EXACT_INT + 1)
    assert problem(pull).startswith("step: must be within")
    check_message(reconciler_pb2.PullBatchRequest(step=MAX_EXACT_INT, wait_s=1.5))


def test_bad_bodies_are_logged_at_most_a_few_times_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from services.wire.requests import RateLimitedLog

    logger = logging.getLogger("test.rate_limited")
    limited = RateLimitedLog(logger, burst=3, interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.rate_limited"):
        for index in range(50):
            limited.warning("bad body %d", index)
    assert [r.getMessage() for r in caplog.records] == [f"bad body {i}" for i in range(3)]


async def test_supervised_loops_are_restarted_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loop that crashes is logged with its traceback, reported as the fault, restarted
    with backoff, and the fault clears once a restart runs for healthy_after_s."""
    import itertools

    from services.wire.supervise import Supervisor

    runs: list[float] = []
    broken = asyncio.Event()
    broken.set()

    async def loop() -> None:
        runs.append(asyncio.get_running_loop().time())
        if broken.is_set():
            raise RuntimeError("key corrupted")
        await asyncio.sleep(3600)

    supervisor = Supervisor("test")
    supervisor.start("reaper", loop, initial_backoff_s=0.05, max_backoff_s=0.2, healthy_after_s=0.1)
    for _ in range(100):
        if len(runs) >= 3:
            break
        await asyncio.sleep(0.02)
    fault = supervisor.fault()
    assert fault is not None and "reaper crashed: RuntimeError: key corrupted" in fault
    gaps = [later - earlier for earlier, later in itertools.pairwise(runs)]
    assert gaps[0] >= 0.045 and gaps[1] >= 0.095  # the backoff doubles
    assert any(r.exc_info for r in caplog.records if "crashed" in r.getMessage())
    broken.clear()
    for _ in range(100):
        if supervisor.fault() is None:
            break
        await asyncio.sleep(0.02)
    assert supervisor.fault() is None
    await supervisor.stop()
    assert supervisor.names == []


class _Lingering(
    inference_pb2_grpc.InferenceServiceServicer, trainer_pb2_grpc.TrainerServiceServicer
):
    """Calls that outlast a shutdown's grace, and one that finishes within it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()  # lets the quick call finish
        self.started = 0
        self.all_started = asyncio.Event()
        self.cleaned_up: list[str] = []

    def _start(self) -> None:
        self.started += 1
        if self.started == 3:
            self.all_started.set()

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        self._start()
        quick = request.prompt_token_ids[0] == 1
        yield inference_pb2.GenerateResponse(token_ids=[7])
        try:
            await (self.release.wait() if quick else asyncio.sleep(3600))
        finally:
            self.cleaned_up.append("quick" if quick else "stream")
        yield inference_pb2.GenerateResponse(token_ids=[8], finish_reason=1)

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> common_pb2.ServiceInfo:
        self._start()
        try:
            await asyncio.sleep(3600)
        finally:
            self.cleaned_up.append("unary")
        return common_pb2.ServiceInfo()


async def test_calls_still_running_at_shutdown_are_handed_back_unavailable() -> None:
    """SIGTERM with calls in flight: one that finishes within grpc.shutdown_grace_s ends
    OK; a stream and a unary call still running then end UNAVAILABLE (which callers
    retry elsewhere), not CANCELLED, their handlers cleaned up, and the server stops."""
    servicer = _Lingering()

    class _LingeringService(Service):
        name = "trainer"

        def register(self, server: aio.Server) -> list[str]:
            inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
            trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
            return ["etude.v1.InferenceService", "etude.v1.TrainerService"]

    port = free_port()
    config = _config(
        port,
        ETUDE_TRAINER__GRPC__SHUTDOWN_GRACE_S="0.5",
        ETUDE_TRAINER__READINESS_INTERVAL_S="0.05",
    )
    stop = asyncio.Event()
    listening = asyncio.Event()
    service = make_service(_LingeringService, config)
    serving = asyncio.create_task(serve(service, stop=stop, on_listening=listening.set))
    await listening.wait()
    before = _counter("GetStatus", "UNAVAILABLE")

    async def read(stream: aio.UnaryStreamCall) -> list[int]:
        return [token async for response in stream for token in response.token_ids]

    async with make_channel(f"127.0.0.1:{port}", token=TOKEN) as channel:
        generate = inference_pb2_grpc.InferenceServiceStub(channel).Generate
        quick = generate(inference_pb2.GenerateRequest(prompt_token_ids=[1]))
        lingering = generate(inference_pb2.GenerateRequest(prompt_token_ids=[2]))
        quick_tokens = asyncio.create_task(read(quick))
        lingering_tokens = asyncio.create_task(read(lingering))
        unary = asyncio.ensure_future(
            trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(common_pb2.StatusRequest())
        )
        await servicer.all_started.wait()
        await asyncio.sleep(0.3)  # readiness re-checked every 0.05 s
        assert service.readiness.ready, service.readiness
        stop.set()
        await asyncio.sleep(0.1)  # two readiness intervals into the grace
        # Not ready again while it drains: the readiness monitor stopped with the server.
        assert service.readiness == Readiness(False, "shutting down")
        assert REGISTRY.get_sample_value("etude_service_ready", {"service": "trainer"}) == 0.0
        servicer.release.set()
        assert await quick_tokens == [7, 8]
        with pytest.raises(aio.AioRpcError) as handed_back:
            await lingering_tokens  # past its first response: a stream is not retried
        assert handed_back.value.code() == grpc.StatusCode.UNAVAILABLE
        assert handed_back.value.details() == HANDED_BACK
        # The unary call is retried by the channel's policy, here into a closed port.
        with pytest.raises(aio.AioRpcError) as retried:
            await unary
        assert retried.value.code() == grpc.StatusCode.UNAVAILABLE
    await asyncio.wait_for(serving, 10)
    assert sorted(servicer.cleaned_up) == ["quick", "stream", "unary"]
    assert await _counted("GetStatus", "UNAVAILABLE", before + 1) - before == 1
