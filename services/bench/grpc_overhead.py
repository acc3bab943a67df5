"""`etude bench grpc`: what the shared server plumbing costs per call.

The same unary RPC (TrainerService/GetStatus) is timed against two servers in
one process: one built by ``services.wire.server`` (OpenTelemetry, metrics,
error mapping, bearer-token auth, client interceptors with deadlines and
retries) and a bare grpc.aio server with the same servicer and a bare channel.
Target: the plumbed server answers at least half as many calls per second as
the bare one (``overhead_ratio`` = bare / plumbed <= 2).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from grpc import aio
from opentelemetry.sdk.trace import TracerProvider

from services.api.v1 import common_pb2, trainer_pb2_grpc
from services.bench import BenchResult
from services.config.deployment import load_config
from services.trainer.service import TrainerService, TrainerServicer
from services.wire.client import make_channel
from services.wire.ports import free_ports
from services.wire.server import build_server, make_service

TARGET_RATIO = 2.0


async def _time_calls(call: Callable[[], Awaitable[object]], num_calls: int) -> list[float]:
    for _ in range(min(50, num_calls)):  # warm-up: connection, caches
        await call()
    latencies = []
    for _ in range(num_calls):
        started = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - started)
    return latencies


def _figures(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "calls_per_s": len(ordered) / sum(ordered),
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
    }


async def _measure(num_calls: int) -> tuple[dict[str, float], dict[str, float]]:
    token = "bench-token"
    plumbed_port, bare_port = free_ports(2)
    config = load_config(
        None,
        {
            "ETUDE_AUTH__TOKEN": token,
            "ETUDE_TRAINER__GRPC__HOST": "127.0.0.1",
            "ETUDE_TRAINER__GRPC__PORT": str(plumbed_port),
            "ETUDE_TRAINER__HTTP__PORT": "0",
        },
    )
    tracer_provider = TracerProvider()
    service = make_service(TrainerService, config, tracer_provider)
    plumbed = build_server(service, tracer_provider).server
    bare = aio.server()
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(service), bare)  # type: ignore[arg-type]
    bare.add_insecure_port(f"127.0.0.1:{bare_port}")
    await plumbed.start()
    await bare.start()
    request = common_pb2.StatusRequest()
    try:
        async with (
            make_channel(
                f"127.0.0.1:{plumbed_port}", token=token, tracer_provider=tracer_provider
            ) as plumbed_channel,
            aio.insecure_channel(f"127.0.0.1:{bare_port}") as bare_channel,
        ):
            plumbed_stub = trainer_pb2_grpc.TrainerServiceStub(plumbed_channel)
            bare_stub = trainer_pb2_grpc.TrainerServiceStub(bare_channel)
            plumbed_latencies = await _time_calls(
                lambda: plumbed_stub.GetStatus(request), num_calls
            )
            bare_latencies = await _time_calls(lambda: bare_stub.GetStatus(request), num_calls)
    finally:
        await plumbed.stop(0)
        await bare.stop(0)
        await service.channels.close()
    return _figures(plumbed_latencies), _figures(bare_latencies)


def run(quick: bool) -> BenchResult:
    """Times `num_calls` sequential unary calls against each server."""
    num_calls = 300 if quick else 3000
    plumbed, bare = asyncio.run(_measure(num_calls))
    ratio = bare["calls_per_s"] / plumbed["calls_per_s"]
    return BenchResult(
        figures={**plumbed, "overhead_ratio": ratio},
        baseline=bare,
        ok=ratio <= TARGET_RATIO,
        target=f"overhead_ratio (bare calls/s / plumbed calls/s) <= {TARGET_RATIO}",
        details={"num_calls": num_calls, "rpc": "TrainerService/GetStatus"},
    )
