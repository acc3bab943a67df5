"""Local TCP ports."""

from __future__ import annotations

import socket
from collections.abc import Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free on `host` a moment ago.

    Every probe stays bound until all are chosen: ports taken one `free_port()` at a time
    can repeat (a released port may be handed out again at once), and two services then
    race for one port.
    """
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind((host, 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def service_ports(names: Sequence[str], host: str = "127.0.0.1") -> dict[str, tuple[int, int]]:
    """A (gRPC, HTTP) port pair for each service in `names`, no port used twice."""
    ports = iter(free_ports(2 * len(names), host))
    return {name: (next(ports), next(ports)) for name in names}
