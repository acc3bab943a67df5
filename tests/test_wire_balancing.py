"""Calls spread over every replica behind one name, and follow replicas added and removed.

Real grpc.aio servers with the services' own server options (``services.wire.options``)
on 127.0.0.2, 127.0.0.3, ... behind one name served by the test's DNS server
(``tests/dns_support.py``), and the services' own channel (``make_channel``). The same
with real inference replicas is ``tests/test_load_balancing.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio

from services.config import GrpcServerConfig
from services.wire.client import make_channel
from services.wire.options import server_options
from services.wire.ports import free_port
from services.wire.retry import RetryPolicy, retrying
from tests.dns_support import serving_zone

NAME = "replicas.etude.test"
AGE_S = 2.0
RESOLUTION_S = 0.5
# A replica added is used within 1.1 x max_connection_age_s + min_resolution_interval_s
# (+ a connection set-up; a test's DNS answers at once, with TTL 0).
BOUND_S = 1.1 * AGE_S + RESOLUTION_S + 2.0
STREAM_MESSAGES = 20  # a 2 s stream, cut by a 0.3 s shutdown grace


class Replica:
    """A server on its own loopback address that answers with that address."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        settings = GrpcServerConfig(
            host=host, port=port, max_connection_age_s=AGE_S, max_connection_age_grace_s=5
        )
        self.server = aio.server(options=server_options(settings))
        handlers = {
            "Who": grpc.unary_unary_rpc_method_handler(self._who),
            "Slow": grpc.unary_stream_rpc_method_handler(self._slow),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Replica", handlers),)
        )
        self.server.add_insecure_port(f"{host}:{port}")

    async def _who(self, request: bytes, context: aio.ServicerContext) -> bytes:
        return self.host.encode()

    async def _slow(self, request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        for _ in range(STREAM_MESSAGES):
            await asyncio.sleep(0.1)
            yield self.host.encode()


async def _who(channel: aio.Channel) -> str:
    answer: bytes = await channel.unary_unary("/test.Replica/Who")(b"", timeout=5)
    return answer.decode()


def _within(counts: Counter[str], hosts: list[str], total: int, tolerance: float) -> bool:
    share = total / len(hosts)
    return all(abs(counts[h] - share) <= tolerance * share for h in hosts)


async def test_calls_split_evenly_and_a_replica_added_is_used_within_the_bound() -> None:
    port = free_port()
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    replicas = [Replica(host, port) for host in hosts]
    with serving_zone() as (zone, dns_port):
        for replica in replicas:
            await replica.server.start()
        zone.set(NAME, hosts[:2])
        async with make_channel(
            f"dns://127.0.0.1:{dns_port}/{NAME}:{port}",
            token=None,
            min_resolution_interval_s=RESOLUTION_S,
        ) as channel:
            before = Counter([await _who(channel) for _ in range(200)])
            assert set(before) == set(hosts[:2]) and _within(before, hosts[:2], 200, 0.25), before

            zone.set(NAME, hosts)  # scaled up: the new replica is ready and listed
            added = time.monotonic()
            while await _who(channel) != hosts[2]:
                assert time.monotonic() - added < BOUND_S, "the new replica got no call"
                await asyncio.sleep(0.02)
            seconds = time.monotonic() - added
            after = Counter([await _who(channel) for _ in range(300)])
            assert _within(after, hosts, 300, 0.25), after
            print(f"before {dict(before)}; new replica served after {seconds:.2f} s; {dict(after)}")
        for replica in replicas:
            await replica.server.stop(None)


@pytest.mark.slow
async def test_a_replica_stopped_mid_stream_loses_no_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    hosts = ["127.0.0.5", "127.0.0.6"]
    replicas = [Replica(host, port) for host in hosts]
    policy = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=20)
    with serving_zone() as (zone, dns_port):
        for replica in replicas:
            await replica.server.start()
        zone.set(NAME, hosts)
        async with make_channel(
            f"dns://127.0.0.1:{dns_port}/{NAME}:{port}",
            token=None,
            min_resolution_interval_s=RESOLUTION_S,
        ) as channel:
            slow = channel.unary_stream("/test.Replica/Slow")
            served: Counter[str] = Counter()

            async def stream() -> str:
                answers = [a async for a in slow(b"", timeout=10)]
                assert len(answers) == STREAM_MESSAGES
                return bytes(answers[-1]).decode()

            async def client() -> None:
                for _ in range(4):
                    served[await retrying(stream, policy, "Slow")] += 1

            # Connected to both first: calls made before that all go to the first one up.
            assert {await _who(channel) for _ in range(4)} == set(hosts)
            clients = asyncio.gather(*(client() for _ in range(6)))
            await asyncio.sleep(2.5)
            assert served[hosts[0]] > 0 and served[hosts[1]] > 0, served
            # Removed: out of the name, and SIGTERM's server.stop with a grace shorter than
            # the streams on it, so some are cut (UNAVAILABLE) and retried on the other.
            zone.set(NAME, hosts[1:])
            await replicas[0].server.stop(0.3)
            await clients
            assert sum(served.values()) == 6 * 4, served
        # Streams were cut on the stopped replica and handed back: each was retried.
        assert any("Slow: UNAVAILABLE" in r.getMessage() for r in caplog.records)
        await replicas[1].server.stop(None)
