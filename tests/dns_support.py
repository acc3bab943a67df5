"""A DNS server for one test: a headless Service's name without Kubernetes.

gRPC's DNS resolver (c-ares) takes the server to ask from the target,
``dns://127.0.0.1:<port>/<name>:<grpc port>``, so a test serves the A records of its
own names on a loopback UDP port, with TTL 0, and changes them as replicas come and go,
the way a headless Service lists its ready pods. Nothing else on the machine is touched
(no /etc/hosts edit, no namespace), and the resolver, its re-resolution and round_robin
are gRPC's own. Replicas bind 127.0.0.2, 127.0.0.3, ... (all of 127.0.0.0/8 is loopback
on Linux), each on the same port, like pods behind one Service.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

_TYPE_A = 1
_CLASS_IN = 1
_NXDOMAIN = 3


class Zone(asyncio.DatagramProtocol):
    """Answers A queries for the names in ``records``; no answer for other types of a
    known name, NXDOMAIN for unknown names. ``queries`` counts the A queries per name,
    ``misses`` the queries answered NXDOMAIN."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.queries: dict[str, int] = {}
        self.misses: dict[str, int] = {}
        self._lock = threading.Lock()
        self._transport: asyncio.DatagramTransport | None = None

    def set(self, name: str, addresses: list[str]) -> None:
        """The addresses `name` resolves to from now on."""
        with self._lock:
            self.records[name] = list(addresses)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        ident, flags = struct.unpack("!HH", data[:4])
        position, labels = 12, []
        while data[position]:
            length = data[position]
            labels.append(data[position + 1 : position + 1 + length].decode().lower())
            position += 1 + length
        qtype, _ = struct.unpack("!HH", data[position + 1 : position + 5])
        question = data[12 : position + 5]
        name = ".".join(labels)
        with self._lock:
            addresses = self.records.get(name)
            if qtype == _TYPE_A and addresses is not None:
                self.queries[name] = self.queries.get(name, 0) + 1
            elif addresses is None:
                self.misses[name] = self.misses.get(name, 0) + 1
        answers = addresses if qtype == _TYPE_A and addresses else []
        rcode = _NXDOMAIN if addresses is None else 0
        # QR, AA, RD copied, RA; one question echoed.
        reply_flags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode
        header = struct.pack("!HHHHHH", ident, reply_flags, 1, len(answers), 0, 0)
        records = b"".join(
            struct.pack("!HHHIH", 0xC00C, _TYPE_A, _CLASS_IN, 0, 4) + socket.inet_aton(address)
            for address in answers
        )
        assert self._transport is not None
        self._transport.sendto(header + question + records, addr)


@contextmanager
def serving_zone(host: str = "127.0.0.1", port: int = 0) -> Iterator[tuple[Zone, int]]:
    """A Zone served on `host` (127.0.0.1; the emulated cluster's gateway address) from a
    thread of its own; yields it and its UDP port (`port`, or a free one)."""
    loop = asyncio.new_event_loop()
    zone = Zone()
    ready = threading.Event()
    bound: list[int] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        transport, _ = loop.run_until_complete(
            loop.create_datagram_endpoint(lambda: zone, local_addr=(host, port))
        )
        bound.append(transport.get_extra_info("sockname")[1])
        ready.set()
        loop.run_forever()
        transport.close()

    thread = threading.Thread(target=run, name="dns-zone", daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield zone, bound[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
