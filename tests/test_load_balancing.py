"""Load follows the replica count: real inference replicas behind one resolvable name.

Three ``python -m services.inference`` processes on the tiny model, each on its own
loopback address (127.0.0.2, .3, .4) and the same port, like pods behind a headless
Service; the name resolves through the test's DNS server (``tests/dns_support.py``),
which lists a replica once it is ready, as Kubernetes does. The client is the envs
worker's own (``InferenceGenerator`` over ``make_channel``), so the channel options, the
retries and the servers' connection ages are the services' own; only the ages are short
(5 s, a resolution at most every second) so the test runs in about two minutes. Calls
are counted by each replica's ``grpc_server_handled_total`` on its /metrics.

1. Two replicas: calls split within ±25 %.
2. A third is started mid-test (the calls pause while it loads: on a small CPU machine
   they would starve its start-up), listed when ready, and must serve within
   1.1 x max_connection_age_s + min_resolution_interval_s + 3 s of being listed; then
   the calls split three ways within ±25 %.
3. One is stopped (SIGTERM, unlisted) with generations in flight: it drains (exits 0)
   and every generation issued comes back whole; a cut one is retried elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.envs.inference_client import InferenceGenerator
from services.wire.client import make_channel
from services.wire.ports import free_port
from tests.conftest import REPO, TOKEN, service_env, stop_process, wait_ready, write_config
from tests.dns_support import serving_zone

pytestmark = [pytest.mark.slow, pytest.mark.integration]

NAME = "inference.etude.test"
AGE_S = 5.0
RESOLUTION_S = 1.0
SHUTDOWN_GRACE_S = 1.0
BOUND_S = 1.1 * AGE_S + RESOLUTION_S + 3.0
WORKERS = 4
MAX_TOKENS = 24

log = logging.getLogger(__name__)
_HANDLED_OK = re.compile(
    r'^grpc_server_handled_total\{(?=[^}]*grpc_method="Generate")(?=[^}]*grpc_code="OK")'
    r"[^}]*\} (\S+)$",
    re.MULTILINE,
)
_STARTED = re.compile(
    r'^grpc_server_started_total\{(?=[^}]*grpc_method="Generate")[^}]*\} (\S+)$', re.MULTILINE
)


class Replica:
    """One inference process bound to `host`."""

    def __init__(self, root: Path, model: Path, host: str, grpc_port: int, http_port: int):
        self.host, self.grpc_port, self.http_port = host, grpc_port, http_port
        self.config = root / f"{host}.toml"
        self.log = root / f"{host}.log"
        write_config(
            self.config,
            model_dir=model,
            state_dir=root / host,
            extra={
                "inference": [
                    f'grpc = {{ host = "{host}", port = {grpc_port}, '
                    f"shutdown_grace_s = {SHUTDOWN_GRACE_S}, max_connection_age_s = {AGE_S}, "
                    "max_connection_age_grace_s = 60 }",
                    f'http = {{ host = "{host}", port = {http_port} }}',
                ]
            },
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # vLLM's automatic binding puts every replica's engine on the same core; one
        # core each, in turn, lets them run side by side.
        cores = sorted(os.sched_getaffinity(0))
        core = cores[int(self.host.rsplit(".", 1)[1]) % len(cores)]
        env = {**service_env(TOKEN), "VLLM_CPU_OMP_THREADS_BIND": str(core)}
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.inference", "--config", str(self.config)],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        assert self.process is not None
        wait_ready(f"{self.host}:{self.grpc_port}", 300, self.process, self.log)

    def _metrics(self) -> str:
        url = f"http://{self.host}:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text: str = response.read().decode()
        return text

    def served(self) -> int:
        """Generate calls this replica answered OK so far."""
        return int(sum(float(v) for v in _HANDLED_OK.findall(self._metrics())))

    def received(self) -> int:
        """Generate calls this replica started so far."""
        return int(sum(float(v) for v in _STARTED.findall(self._metrics())))

    def stop(self) -> int:
        return stop_process(self.process) if self.process is not None else 0


def _even(counts: dict[str, int], tolerance: float = 0.25) -> bool:
    share = sum(counts.values()) / len(counts)
    return all(abs(n - share) <= tolerance * share for n in counts.values())


@pytest.fixture
def replicas(tiny_model: Path, tmp_path: Path) -> Iterator[list[Replica]]:
    grpc_port, http_port = free_port(), free_port()
    made = [Replica(tmp_path, tiny_model, f"127.0.0.{i}", grpc_port, http_port) for i in (2, 3, 4)]
    try:
        yield made
    finally:
        for replica in made:
            replica.stop()


class Load:
    """WORKERS envs-style callers, each making one generation after another until
    stopped; counts what was issued and what came back."""

    def __init__(self, generate: InferenceGenerator) -> None:
        self.generate = generate
        self.issued = self.returned = 0
        self._running = False
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._running = True
        self._workers = [asyncio.create_task(self._worker(i)) for i in range(WORKERS)]

    async def stop(self) -> None:
        """Lets every call in flight finish; raises what a worker raised."""
        self._running = False
        workers, self._workers = self._workers, []
        for result in await asyncio.gather(*workers, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    async def _worker(self, index: int) -> None:
        prompt = [5 + index, 17, 29, 31]
        while self._running:
            self.issued += 1
            generation = await self.generate(prompt, max_tokens=MAX_TOKENS, stop=[])
            assert generation.token_ids and generation.finish_reason != "FINISH_REASON_ABORT"
            self.returned += 1


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():  # noqa: ASYNC110 - polls counters and metrics
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"no {what} within {timeout_s:.1f} s") from None


async def test_load_follows_replicas_added_and_removed(
    replicas: list[Replica], caplog: pytest.LogCaptureFixture
) -> None:
    a, b, c = replicas
    a.start()
    b.start()
    await asyncio.to_thread(a.wait_ready)
    await asyncio.to_thread(b.wait_ready)
    with serving_zone() as (zone, dns_port):
        zone.set(NAME, [a.host, b.host])
        channel = make_channel(
            f"dns://127.0.0.1:{dns_port}/{NAME}:{a.grpc_port}",
            token=TOKEN,
            default_timeout_s=300,
            min_resolution_interval_s=RESOLUTION_S,
        )
        generate = InferenceGenerator(channel, temperature=1.0, seed=None, unavailable_wait_s=60)
        load = Load(generate)
        async with channel:
            try:
                # Count only once the channel has a connection to both: calls made before
                # then go to the first one up.
                async with asyncio.timeout(60):
                    while not (a.received() and b.received()):
                        await generate([3, 4, 5], max_tokens=2, stop=[])

                # 1. Two replicas.
                start = {r.host: r.served() for r in (a, b)}
                load.start()
                await _until(lambda: load.returned >= 80, "80 generations")
                await load.stop()
                before = {r.host: r.served() - start[r.host] for r in (a, b)}
                log.info("two replicas: %s", before)
                assert _even(before), before

                # 2. A third replica is started (the calls pause meanwhile: on a CPU
                # machine its start-up would otherwise compete with them for the cores),
                # listed once ready, and serves within the bound.
                c.start()
                await asyncio.to_thread(c.wait_ready)
                load.start()
                await _until(lambda: load.returned >= 88, "calls resumed")
                zone.set(NAME, [a.host, b.host, c.host])
                listed = time.monotonic()
                queries = zone.queries.get(NAME, 0)
                try:
                    await _until(lambda: c.received() > 0, "call on the new replica", BOUND_S)
                except AssertionError as error:
                    resolved = zone.queries.get(NAME, 0) - queries
                    raise AssertionError(
                        f"{error}; the name was resolved {resolved} times"
                    ) from None
                seconds = time.monotonic() - listed
                start = {r.host: r.served() for r in replicas}
                await _until(
                    lambda: sum(r.served() for r in replicas) - sum(start.values()) >= 120,
                    "120 generations on three replicas",
                )
                after = {r.host: r.served() - start[r.host] for r in replicas}
                log.info("new replica served after %.2f s; three replicas: %s", seconds, after)
                assert _even(after), after

                # 3. Scaled down: b is unlisted and drains on SIGTERM mid-generation.
                zone.set(NAME, [a.host, c.host])
                exit_code = await asyncio.to_thread(b.stop)
                assert exit_code == 0, b.log.read_text()
                mark = load.returned
                await _until(lambda: load.returned >= mark + 20, "20 generations after the stop")
            finally:
                await load.stop()
    assert load.returned == load.issued
    retried = sum("inference Generate: UNAVAILABLE" in r.getMessage() for r in caplog.records)
    print(
        f"\nrequests per replica, two replicas: {before}\n"
        f"new replica served {seconds:.2f} s after it was listed (bound {BOUND_S:.1f} s)\n"
        f"requests per replica, three replicas: {after}\n"
        f"replica {b.host} stopped mid-load: {load.issued} generations issued, "
        f"{load.returned} returned, {retried} retried after UNAVAILABLE"
    )
