"""`etude bench reconciler`: full slot lifecycles per second against one Redis.

Worker processes (1, 2, 4, 8) run claim -> heartbeat -> complete through the
reconciler's Lua scripts (the same SlotStore the service uses) against a private
redis-server with AOF (appendfsync everysec), as deployed. The baseline, in the same
run and with the same number of processes, is raw PING round trips per second, so
``lifecycles_per_s`` reads as a fraction of what this Redis and these cores can do
(``ops_fraction_of_ping`` = 3 scripts per lifecycle / PINGs). Redis's own CPU time
per lifecycle (``redis_us_per_lifecycle``, from INFO commandstats) gives the
capacity of one Redis when workers run on other machines, as they do in a cluster
(``redis_capacity_lifecycles_per_s``). The workers' own CPU time per lifecycle
(``worker_cpu_us_per_lifecycle``) is the client's share; with Redis's, it says what the
cores can carry even when another job shares them. Target (issue): ``lifecycles_per_s``
>= 5,000 and ``claim_p99_ms`` < 5.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
import uvloop

from services.api.v1 import common_pb2, reconciler_pb2
from services.bench import BenchResult
from services.launcher.redis_server import start_private_redis
from services.reconciler.config import ReconcilerConfig
from services.reconciler.store import SlotStore

TARGET_LIFECYCLES = 5000.0
TARGET_CLAIM_P99_MS = 5.0
RUN = "bench"


def _summary(slot_id: str) -> common_pb2.RolloutSummary:
    return common_pb2.RolloutSummary(
        rollout_id=f"r-{slot_id.replace('/', '-')}",
        record=common_pb2.ObjectRef(key=f"rollouts/{slot_id}", sha256="0" * 64),
    )


async def _lifecycles(url: str, worker: int, duration_s: float) -> dict[str, Any]:
    client = aioredis.from_url(url)
    store = SlotStore(client, RUN, ReconcilerConfig(lease_ttl_s=30))
    claim_ms: list[float] = []
    done = 0
    cpu_started = time.process_time()
    deadline = time.perf_counter() + duration_s
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        claimed = await store.claim(f"bench-{worker}", [], 1, 30)
        claim_ms.append((time.perf_counter() - started) * 1e3)
        if not claimed:
            break
        lease = claimed[0].lease
        await store.heartbeat(lease.slot_id, lease.lease_token)
        await store.complete(lease.slot_id, lease.lease_token, _summary(lease.slot_id))
        done += 1
    cpu_s = time.process_time() - cpu_started
    await client.aclose()
    return {"done": done, "claim_ms": claim_ms, "cpu_s": cpu_s}


async def _pings(url: str, duration_s: float) -> dict[str, Any]:
    client = aioredis.from_url(url)
    done = 0
    deadline = time.perf_counter() + duration_s
    while time.perf_counter() < deadline:
        await client.ping()
        done += 1
    await client.aclose()
    return {"done": done}


def _process(
    kind: str, url: str, worker: int, duration_s: float, start_at: float
) -> dict[str, Any]:
    time.sleep(max(0.0, start_at - time.time()))  # every process starts together
    # uvloop, as in the reconciler service; PINGs run on the same loop and client.
    if kind == "ping":
        return uvloop.run(_pings(url, duration_s))
    return uvloop.run(_lifecycles(url, worker, duration_s))


def _parallel(kind: str, url: str, workers: int, duration_s: float) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 1.5  # after the spawned interpreters have imported
    with context.Pool(workers) as pool:
        return pool.starmap(
            _process, [(kind, url, w, duration_s, start_at) for w in range(workers)]
        )


async def _submit(url: str, num_slots: int) -> None:
    client = aioredis.from_url(url)
    store = SlotStore(client, RUN, ReconcilerConfig())
    task = common_pb2.Task(
        task_id="bench", family="synthetic", grading=common_pb2.GradingSpec(command=["true"])
    )
    spec = reconciler_pb2.GroupSpec(task=task, num_samples=8, kind=common_pb2.SLOT_KIND_TRAIN)
    for _ in range(0, num_slots, 8 * 500):
        await store.submit([spec] * 500)
    await client.aclose()


def run(quick: bool) -> BenchResult:
    """Lifecycles/s and claim latency for 1..8 worker processes, PING/s as the baseline."""
    duration_s = 1.0 if quick else 3.0
    worker_counts = (1, 4) if quick else (1, 2, 4, 8)
    by_workers: dict[str, float] = {}
    pings: dict[str, float] = {}
    latencies: dict[int, list[float]] = {}
    server_us: dict[int, float] = {}
    worker_us: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as state:
        redis_process, url = start_private_redis(Path(state))
        try:
            admin = redis.Redis.from_url(url)
            for workers in worker_counts:
                asyncio.run(_submit(url, int(20_000 * duration_s * workers**0.5)))
                admin.config_resetstat()
                results = _parallel("lifecycles", url, workers, duration_s)
                script_us = admin.info("commandstats")["cmdstat_evalsha"]["usec"]
                server_us[workers] = script_us / max(1, sum(r["done"] for r in results))
                worker_us[workers] = (
                    1e6 * sum(r["cpu_s"] for r in results) / max(1, sum(r["done"] for r in results))
                )
                by_workers[str(workers)] = sum(r["done"] for r in results) / duration_s
                latencies[workers] = [ms for r in results for ms in r["claim_ms"]]
                ping_results = _parallel("ping", url, workers, duration_s)
                pings[str(workers)] = sum(r["done"] for r in ping_results) / duration_s
            admin.close()
        finally:
            redis_process.stop(5)
    best = max(by_workers, key=lambda w: by_workers[w])
    loaded = sorted(latencies[max(worker_counts)])
    p50 = statistics.median(loaded)
    p99 = loaded[int(0.99 * (len(loaded) - 1))]
    figures = {
        "lifecycles_per_s": by_workers[best],
        "claim_p50_ms": p50,
        "claim_p99_ms": p99,
        "ops_fraction_of_ping": 3 * by_workers[best] / pings[best],
        "redis_us_per_lifecycle": server_us[int(best)],
        "redis_capacity_lifecycles_per_s": 1e6 / server_us[int(best)],
        "worker_cpu_us_per_lifecycle": worker_us[int(best)],
        **{f"lifecycles_per_s_{w}_workers": v for w, v in by_workers.items()},
    }
    return BenchResult(
        figures=figures,
        baseline={f"ping_per_s_{w}_workers": v for w, v in pings.items()},
        ok=figures["lifecycles_per_s"] >= TARGET_LIFECYCLES and p99 < TARGET_CLAIM_P99_MS,
        target=(
            f"lifecycles_per_s >= {TARGET_LIFECYCLES:.0f} and claim_p99_ms < "
            f"{TARGET_CLAIM_P99_MS} (claim latency at {max(worker_counts)} workers)"
        ),
        details={
            "duration_s": duration_s,
            "best_workers": int(best),
            "cpu_count": multiprocessing.cpu_count(),
        },
    )
