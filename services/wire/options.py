"""The gRPC channel and server options of every service, in one place.

Load follows the replica count: a Service name (a Kubernetes headless Service) resolves
to every ready replica, and clients keep a connection to each (``round_robin``), sending
successive calls to successive replicas. A client learns of replicas added since it
last resolved only when it resolves again, which gRPC's DNS resolver does when one of
its connections closes; so servers close every connection after ``max_connection_age_s``
(gRPC adds up to ±10 % jitter) with a GOAWAY, which lets the calls on it finish for up to
``max_connection_age_grace_s`` and sends new ones over the other connections meanwhile.
A replica added is therefore used within about

    1.1 x max_connection_age_s + the DNS record's TTL + one connection set-up

once it is ready (and no sooner than ``min_resolution_interval_s`` after the previous
resolution): about 40 s with the defaults (30 s, CoreDNS's 5 s TTL), under 60 s. A
replica removed stops taking calls at SIGTERM (``services.wire.server``): its GOAWAY
sends clients to the others, and calls it cannot finish within ``shutdown_grace_s`` end
UNAVAILABLE, which callers retry elsewhere.
"""

from __future__ import annotations

import json
from typing import Any

from services.config import MIB, GrpcServerConfig

RETRYABLE_CODES = ("UNAVAILABLE",)

Options = list[tuple[str, Any]]


def service_config(max_attempts: int = 4) -> str:
    """gRPC service config: ``round_robin`` over every address the target resolves to,
    and UNAVAILABLE retried with exponential backoff for every method.

    gRPC caps ``max_attempts`` at 5, and retries a streaming call only until its first
    response arrives. A retry goes to the next replica in the rotation."""
    return json.dumps(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            "methodConfig": [
                {
                    "name": [{}],
                    "retryPolicy": {
                        "maxAttempts": max_attempts,
                        "initialBackoff": "0.1s",
                        "maxBackoff": "2s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": list(RETRYABLE_CODES),
                    },
                }
            ],
        }
    )


def channel_options(
    *,
    max_message_bytes: int = 64 * MIB,
    max_attempts: int = 4,
    min_resolution_interval_s: float = 30.0,
) -> Options:
    """Options of a client channel: message sizes, the service config above, keepalive,
    and how soon the DNS resolver may resolve again after it last did."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(max_attempts)),
        # The service config above is the only one; no TXT lookups for another.
        ("grpc.service_config_disable_resolution", 1),
        ("grpc.dns_min_time_between_resolutions_ms", round(min_resolution_interval_s * 1000)),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def server_options(settings: GrpcServerConfig) -> Options:
    """Options of a service's server: message sizes, and connections closed after
    ``max_connection_age_s`` so that clients resolve again and find new replicas."""
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_connection_age_ms", round(settings.max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", round(settings.max_connection_age_grace_s * 1000)),
    ]
