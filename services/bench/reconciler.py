"""`etude bench reconciler`: full slot lifecycles per second against one Redis.

Worker processes (1, 2, 4, 8) run claim -> heartbeat -> complete through the
reconciler's Lua scripts (the same SlotStore the service uses) against a private
redis-server with AOF (appendfsync everysec), as deployed. Each process works as an envs
worker does: it holds up to ``BATCH`` rollouts at once, claims as many slots as it has
free places in one call, renews all of its leases in one heartbeat call and completes
each slot on its own (``lifecycles_per_s``). The same run measures one slot per call
(``lifecycles_per_s_unbatched``: claim 1, heartbeat 1, complete 1). The baseline, in
the same run and with the same number of processes, is raw PING round trips per
second, so the figures read as a fraction of what this Redis and these cores can do
(``calls_fraction_of_ping``: reconciler calls per second over PINGs per second).
Redis's own CPU time per lifecycle (``redis_us_per_lifecycle``, from INFO
commandstats) gives the capacity of one Redis when workers run on other machines, as
they do in a cluster (``redis_capacity_lifecycles_per_s``). The workers' own CPU time
per lifecycle (``worker_cpu_us_per_lifecycle``) is the client's share; with Redis's, it
says what the cores can carry even when another job shares them. Target (issue):
``lifecycles_per_s`` >= 5,000 and ``claim_p99_ms`` < 5.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
import uvloop

from services.api.v1 import common_pb2, reconciler_pb2
from services.bench import BenchResult
from services.config.reconciler import ReconcilerConfig
from services.launcher.redis_server import start_private_redis
from services.reconciler.store import SlotStore

TARGET_LIFECYCLES = 5000.0
TARGET_CLAIM_P99_MS = 5.0
# Rollouts a worker process holds at once (an envs replica's `workers`): it claims as
# many slots as it has free places and renews all of its leases in one call.
BATCH = 8
RUN = "bench"


def _summary(slot_id: str) -> common_pb2.RolloutSummary:
    return common_pb2.RolloutSummary(
        rollout_id=f"r-{slot_id.replace('/', '-')}",
        record=common_pb2.ObjectRef(key=f"rollouts/{slot_id}", sha256="0" * 64),
    )


async def _lifecycles(url: str, worker: int, batch: int, duration_s: float) -> dict[str, Any]:
    client = aioredis.from_url(url)
    store = SlotStore(client, RUN, ReconcilerConfig(lease_ttl_s=30))
    claim_ms: list[float] = []
    done = 0
    calls = 0
    cpu_started = time.process_time()
    deadline = time.perf_counter() + duration_s
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        claimed = await store.claim(f"bench-{worker}", [], batch, 30)
        claim_ms.append((time.perf_counter() - started) * 1e3)
        if not claimed:
            break
        leases = [(slot.lease.slot_id, slot.lease.lease_token) for slot in claimed]
        renewed = await store.heartbeat_many(leases)
        assert all(not problem for _, problem in renewed), renewed
        for slot_id, token in leases:
            await store.complete(slot_id, token, _summary(slot_id))
        done += len(leases)
        calls += 2 + len(leases)
    cpu_s = time.process_time() - cpu_started
    await client.aclose()
    return {"done": done, "calls": calls, "claim_ms": claim_ms, "cpu_s": cpu_s}


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
    kind: str, url: str, worker: int, batch: int, duration_s: float, start_at: float
) -> dict[str, Any]:
    time.sleep(max(0.0, start_at - time.time()))  # every process starts together
    # uvloop, as in the reconciler service; PINGs run on the same loop and client.
    if kind == "ping":
        return uvloop.run(_pings(url, duration_s))
    return uvloop.run(_lifecycles(url, worker, batch, duration_s))


def _parallel(
    kind: str, url: str, workers: int, duration_s: float, batch: int = 1
) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 1.5  # after the spawned interpreters have imported
    with context.Pool(workers) as pool:
        return pool.starmap(
            _process, [(kind, url, w, batch, duration_s, start_at) for w in range(workers)]
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


@dataclass
class _Mode:
    """One way of working (slots per claim) measured at each number of workers."""

    batch: int
    duration_s: float
    done: dict[int, int] = field(default_factory=dict)  # lifecycles by workers
    calls: dict[int, int] = field(default_factory=dict)  # reconciler calls by workers
    server_us: dict[int, float] = field(default_factory=dict)
    worker_us: dict[int, float] = field(default_factory=dict)
    claim_ms: dict[int, list[float]] = field(default_factory=dict)

    def measure(self, admin: redis.Redis, url: str, workers: int) -> None:
        asyncio.run(_submit(url, int(20_000 * self.duration_s * workers**0.5)))
        admin.config_resetstat()
        results = _parallel("lifecycles", url, workers, self.duration_s, self.batch)
        self.done[workers] = sum(r["done"] for r in results)
        self.calls[workers] = sum(r["calls"] for r in results)
        done = max(1, self.done[workers])
        script_us = admin.info("commandstats")["cmdstat_evalsha"]["usec"]
        self.server_us[workers] = script_us / done
        self.worker_us[workers] = 1e6 * sum(r["cpu_s"] for r in results) / done
        self.claim_ms[workers] = [ms for r in results for ms in r["claim_ms"]]

    def rate(self, workers: int) -> float:
        """Lifecycles per second."""
        return self.done[workers] / self.duration_s

    def calls_per_s(self, workers: int) -> float:
        return self.calls[workers] / self.duration_s

    def calls_per_lifecycle(self, workers: int) -> float:
        return self.calls[workers] / max(1, self.done[workers])

    def best(self) -> int:
        return max(self.done, key=self.rate)

    def claim_percentiles(self, workers: int) -> tuple[float, float]:
        loaded = sorted(self.claim_ms[workers])
        return statistics.median(loaded), loaded[int(0.99 * (len(loaded) - 1))]


def run(quick: bool) -> BenchResult:
    """Lifecycles/s and claim latency for 1..8 worker processes, batched and one slot per
    call; PING/s as the baseline."""
    duration_s = 1.0 if quick else 3.0
    worker_counts = (1, 4) if quick else (1, 2, 4, 8)
    batched, single = _Mode(BATCH, duration_s), _Mode(1, duration_s)
    pings: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as state:
        redis_process, url = start_private_redis(Path(state))
        try:
            admin = redis.Redis.from_url(url)
            for workers in worker_counts:
                batched.measure(admin, url, workers)
                single.measure(admin, url, workers)
                ping_results = _parallel("ping", url, workers, duration_s)
                pings[workers] = sum(r["done"] for r in ping_results) / duration_s
            admin.close()
        finally:
            redis_process.stop(5)
    most = max(worker_counts)
    p50, p99 = batched.claim_percentiles(most)
    single_p50, single_p99 = single.claim_percentiles(most)
    best, single_best = batched.best(), single.best()
    figures = {
        "lifecycles_per_s": batched.rate(best),
        "claim_p50_ms": p50,
        "claim_p99_ms": p99,
        "calls_fraction_of_ping": batched.calls_per_s(best) / pings[best],
        "calls_per_lifecycle": batched.calls_per_lifecycle(best),
        "redis_us_per_lifecycle": batched.server_us[best],
        "redis_capacity_lifecycles_per_s": 1e6 / batched.server_us[best],
        "worker_cpu_us_per_lifecycle": batched.worker_us[best],
        "lifecycles_per_s_unbatched": single.rate(single_best),
        "claim_p50_ms_unbatched": single_p50,
        "claim_p99_ms_unbatched": single_p99,
        "calls_fraction_of_ping_unbatched": single.calls_per_s(single_best) / pings[single_best],
        "calls_per_lifecycle_unbatched": single.calls_per_lifecycle(single_best),
        "redis_us_per_lifecycle_unbatched": single.server_us[single_best],
        "worker_cpu_us_per_lifecycle_unbatched": single.worker_us[single_best],
        "batched_speedup": batched.rate(best) / single.rate(single_best),
        **{f"lifecycles_per_s_{w}_workers": batched.rate(w) for w in batched.done},
        **{f"lifecycles_per_s_{w}_workers_unbatched": single.rate(w) for w in single.done},
    }
    return BenchResult(
        figures=figures,
        baseline={f"ping_per_s_{w}_workers": v for w, v in pings.items()},
        ok=figures["lifecycles_per_s"] >= TARGET_LIFECYCLES and p99 < TARGET_CLAIM_P99_MS,
        target=(
            f"lifecycles_per_s >= {TARGET_LIFECYCLES:.0f} and claim_p99_ms < "
            f"{TARGET_CLAIM_P99_MS} (claims of up to {BATCH} slots, latency at {most} workers)"
        ),
        details={
            "duration_s": duration_s,
            "slots_per_worker": BATCH,
            "best_workers": best,
            "best_workers_unbatched": single_best,
            "cpu_count": multiprocessing.cpu_count(),
        },
    )
