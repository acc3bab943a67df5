"""The pod network of the emulated cluster (tests/kubelet_support.py): a bridge, one
network namespace per pod with its own address on it, and cluster DNS.

Everything is named with one random prefix (``et<4 hex>``) and removed on `close` (also
at exit): the namespaces, their veths, the bridge, ``/etc/netns/<namespace>/``. The pods'
subnet is a random 10.x.y.0/24 with no route out: a pod reaches only the other pods and
the gateway address ``.1``, which is the test process's own veth into the bridge; the
cluster DNS (tests/dns_support.py) listens there on port 53. ``ip netns exec`` bind-mounts
``/etc/netns/<namespace>/{hosts,resolv.conf}`` over ``/etc``, so every pod resolves
Service names the Kubernetes way (search ``<ns>.svc.cluster.local svc.cluster.local
cluster.local``, ``ndots:5``), and its own name from its hosts file.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

from tests.dns_support import Zone, serving_zone

CLUSTER_DOMAIN = "cluster.local"
NETNS_ETC = Path("/etc/netns")


# Names and subnets are drawn from the OS, not the `random` module: in-process training
# jobs seed it (services/trainer/job.py), and two networks drawn after the same seed got
# the same prefix, so a veth of the first, whose namespace the kernel was still tearing
# down, made the second's "ip link add" fail.
_draw = random.SystemRandom()


class IpCommandError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}: {(self.stderr or '').strip()}"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise IpCommandError(done.returncode, done.args, done.stdout, done.stderr)


def _used_subnets() -> list[ipaddress.IPv4Network]:
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True)
    found = []
    for line in routes.stdout.splitlines():
        first = line.split()[0]
        if first != "default":
            found.append(ipaddress.ip_network(first, strict=False))
    return found


def netns_pids(netns: str) -> list[int]:
    """The processes in network namespace `netns`."""
    listed = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(pid) for pid in listed.stdout.split()]


def remove_namespace(netns: str) -> list[str]:
    """Removes network namespace `netns`, its /etc/netns files and any process still in
    it (which would keep the namespace, and its veth, alive unnamed); returns what it
    removed."""
    removed = []
    for pid in netns_pids(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid} in {netns}")
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "del", netns)  # its eth0 goes with it, and so the veth's peer
        removed.append(f"netns {netns}")
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
    return removed


def remove_network(prefix: str) -> list[str]:
    """Removes every namespace (as `remove_namespace` does) and link named with `prefix`,
    whoever made them; returns what it removed."""
    removed = []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for netns in (line.split()[0] for line in listed.splitlines() if line.split()):
        if netns.startswith(f"{prefix}-"):
            removed += remove_namespace(netns)
    for link in (f"{prefix}-h", f"{prefix}-br"):
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", link)
            removed.append(f"link {link}")
    return removed


class PodNetwork:
    """A bridge with a gateway address for the test process, and a DNS zone on it."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.prefix = f"et{_draw.getrandbits(16):04x}"
        used = _used_subnets()
        while True:
            subnet = ipaddress.ip_network(
                f"10.{_draw.randrange(64, 250)}.{_draw.randrange(1, 250)}.0/24"
            )
            if not any(subnet.overlaps(other) for other in used):
                break
        self.subnet = subnet
        self.gateway = str(subnet.network_address + 1)
        self._next_host = 10
        self._pods: dict[str, str] = {}  # pod name -> netns
        self._closed = False
        self.bridge = f"{self.prefix}-br"
        atexit.register(self.close)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        # The test process's own veth into the bridge, holding the gateway address.
        _ip("link", "add", f"{self.prefix}-h", "type", "veth", "peer", "name", f"{self.prefix}-hb")
        _ip("link", "set", f"{self.prefix}-hb", "master", self.bridge, "up")
        _ip("addr", "add", f"{self.gateway}/24", "dev", f"{self.prefix}-h")
        _ip("link", "set", f"{self.prefix}-h", "up")
        self._dns = serving_zone(self.gateway, 53)
        self.zone: Zone = self._dns.__enter__()[0]

    def add_pod(self, pod: str, hostname: str, subdomain: str | None = None) -> tuple[str, str]:
        """A network namespace for `pod` with its address; returns (netns, address)."""
        index = self._next_host
        self._next_host += 1
        address = str(self.subnet.network_address + index)
        netns = f"{self.prefix}-{pod}"
        veth = f"{self.prefix}-v{index}"
        self._pods[pod] = netns
        etc = NETNS_ETC / netns
        etc.mkdir(parents=True, exist_ok=True)
        names = [hostname]
        if subdomain:  # a StatefulSet pod under its headless Service
            names.insert(0, f"{hostname}.{subdomain}.{self.namespace}.svc.{CLUSTER_DOMAIN}")
        (etc / "hosts").write_text(
            f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n{address} {' '.join(names)}\n"
        )
        search = [f"{self.namespace}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN]
        (etc / "resolv.conf").write_text(
            f"nameserver {self.gateway}\nsearch {' '.join(search)}\noptions ndots:5\n"
        )
        _ip("netns", "add", netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return netns, address

    def remove_pod(self, pod: str) -> None:
        netns = self._pods.pop(pod, None)
        if netns is not None:
            remove_namespace(netns)

    def fqdn(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc.{CLUSTER_DOMAIN}"

    def unknown_service_lookups(self) -> list[str]:
        """Names looked up in the release's namespace that no Service or pod had:
        ``<name>.<namespace>.svc.cluster.local`` answered NXDOMAIN."""
        suffix = f".{self.namespace}.svc.{CLUSTER_DOMAIN}"
        return sorted(
            name[: -len(suffix)]
            for name in list(self.zone.misses)
            if name.endswith(suffix) and "." not in name[: -len(suffix)]
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pods.clear()
        with contextlib.suppress(Exception):
            self._dns.__exit__(None, None, None)
        remove_network(self.prefix)
