"""Local TCP ports.

Ports are chosen below the kernel's ephemeral range (``ip_local_port_range``, where
outgoing connections get their local ports). A port chosen inside it was free when
chosen, but until the service binds it any ``connect()`` on the machine may take it as
its local port (a torchrun rendezvous, gloo's pairs, a client), and the service then
fails with "address already in use". Below the range only another listener can take it.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

# Above the well-known and most registered service ports (Postgres, Redis, Prometheus,
# Grafana all sit below 10,000), below the ephemeral ranges of Linux (32768-60999 by
# default) and of IANA / BSD / macOS (49152-65535).
LOWEST = 20_000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_START = 32_768


def ephemeral_start(path: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The lowest port the kernel hands to outgoing connections."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the caller binds it soon after)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free on `host` a moment ago, below the
    ephemeral range where the machine allows it (the kernel's choice otherwise).

    Every probe stays bound until all are chosen, so no port is handed out twice.
    """
    top = min(ephemeral_start(), DEFAULT_EPHEMERAL_START)
    candidates = list(range(LOWEST, top))
    random.SystemRandom().shuffle(candidates)
    probes: list[socket.socket] = []
    try:
        for port in candidates:
            if len(probes) == count:
                break
            probe = socket.socket()
            try:
                probe.bind((host, port))
            except OSError:
                probe.close()
                continue
            probes.append(probe)
        while len(probes) < count:  # no room below the ephemeral range: the kernel picks
            probe = socket.socket()
            probe.bind((host, 0))
            probes.append(probe)
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def service_ports(names: Sequence[str], host: str = "127.0.0.1") -> dict[str, tuple[int, int]]:
    """A (gRPC, HTTP) port pair for each service in `names`, no port used twice."""
    ports = iter(free_ports(2 * len(names), host))
    return {name: (next(ports), next(ports)) for name in names}
