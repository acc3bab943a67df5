"""Faults are normal: workers killed and frozen, Redis killed and restarted, the trainer
killed before its commit. Nothing is lost, nothing is counted twice."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
from grpc import aio

from services.launcher.processes import ManagedProcess
from services.launcher.redis_server import redis_answers, start_private_redis
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel
from tests.conftest import REPO, TOKEN
from tests.reconciler_support import ReconcilerProcess, reconciler
from tests.test_reconciler_store import rollout, spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class Workers:
    """Worker processes that a test kills, freezes and restarts."""

    target: str
    log_dir: Path
    ttl_s: float
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    generation: Counter[str] = field(default_factory=Counter)

    def start(self, name: str) -> None:
        self.generation[name] += 1
        self.processes[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.reconciler_worker",
                "--target",
                self.target,
                "--token",
                TOKEN,
                "--worker-id",
                f"{name}.{self.generation[name]}",
                "--log",
                str(self.log_dir / f"{name}.log"),
                "--ttl-s",
                str(self.ttl_s),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_dir / f"{name}.err", "ab"),  # noqa: SIM115 - lives with the process
            start_new_session=True,
        )

    def kill(self, name: str) -> None:
        process = self.processes[name]
        process.kill()
        process.wait()

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait()

    def lines(self) -> list[list[str]]:
        return [
            line.split()
            for path in self.log_dir.glob("*.log")
            for line in path.read_text().splitlines()
        ]


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Workers]]:
    made: list[Workers] = []
    yield made
    for pool in made:
        pool.stop_all()


async def consume_all(
    server: ReconcilerProcess,
    num_groups: int,
    *,
    batch: int,
    timeout_s: float,
    trained: list[str] | None = None,
) -> list[str]:
    """A trainer: pulls batches step by step and commits each; returns group ids in order."""
    trained = [] if trained is None else trained
    async with make_channel(server.target, token=TOKEN, default_timeout_s=10) as channel:
        client = ReconcilerClient(channel)
        step = 0
        async with asyncio.timeout(timeout_s):
            while len(trained) < num_groups:
                step += 1
                while True:
                    try:
                        answer = await client.pull_batch("trainer", step, batch, 0, wait_s=0.5)
                        if not answer.groups:
                            continue
                        ids = [g.group_id for g in answer.groups]
                        for group in answer.groups:
                            assert len(group.rollouts) == group.num_samples
                        await client.commit("trainer", step, ids)
                        trained.extend(ids)
                        break
                    except aio.AioRpcError as error:  # Redis restarting: retry the step
                        if error.code() not in (
                            grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                        ):
                            raise
                        await asyncio.sleep(0.2)
    return trained


def check_exactly_once(
    lines: list[list[str]], trained: list[str], num_groups: int, k: int
) -> Counter[str]:
    assert len(trained) == num_groups and len(set(trained)) == num_groups
    done: dict[str, set[str]] = defaultdict(set)
    kinds: Counter[str] = Counter(line[0] for line in lines)
    for line in lines:
        if line[0] == "done" and line[3] == "0":
            done[line[1]].add(line[2])
    # Each slot was acknowledged as completed (non-duplicate) at most once.
    assert all(len(ids) == 1 for ids in done.values()), {
        s: i for s, i in done.items() if len(i) > 1
    }
    assert len(done) <= num_groups * k
    return kinds


def counts(server: ReconcilerProcess) -> dict[str, int]:
    client = redis.Redis.from_url(server.redis_url)
    try:
        raw = client.hgetall(f"etude:{{{server.run_name}}}:counts")
    finally:
        client.close()
    return {k.decode(): int(v) for k, v in raw.items()}


def test_chaos_workers_killed_and_frozen(tmp_path: Path, workers: list[Workers]) -> None:
    """8 worker processes, 500 groups x K=4, workers SIGKILLed, restarted and frozen past
    their leases throughout: every group ready and trained exactly once."""
    num_groups, k = 500, 4
    extra = "lease_ttl_s = 1.0\nmax_attempts = 100"
    with reconciler(tmp_path, extra=extra) as server:

        async def submit() -> None:
            async with make_channel(server.target, token=TOKEN) as channel:
                client = ReconcilerClient(channel)
                for _ in range(0, num_groups, 100):
                    await client.submit_many([spec(k=k) for _ in range(100)])

        asyncio.run(submit())
        pool = Workers(server.target, tmp_path, ttl_s=1.0)
        workers.append(pool)
        names = [f"w{i}" for i in range(8)]
        for name in names:
            pool.start(name)
        rng = random.Random(1)
        kills = freezes = 0

        async def chaos(done: asyncio.Event) -> None:
            nonlocal kills, freezes
            while not done.is_set():
                await asyncio.sleep(rng.uniform(0.2, 0.6))
                name = rng.choice(names)
                if rng.random() < 0.25:
                    # Frozen longer than its lease: it wakes up and completes late.
                    os.kill(pool.processes[name].pid, signal.SIGSTOP)
                    await asyncio.sleep(1.6)
                    os.kill(pool.processes[name].pid, signal.SIGCONT)
                    freezes += 1
                else:
                    pool.kill(name)
                    pool.start(name)
                    kills += 1

        async def run() -> list[str]:
            done = asyncio.Event()
            monkey = asyncio.create_task(chaos(done))
            try:
                return await consume_all(server, num_groups, batch=20, timeout_s=300)
            finally:
                done.set()
                await monkey

        trained = asyncio.run(run())
        time.sleep(0.5)  # let frozen-then-woken workers report
        pool.stop_all()
        final = counts(server)
    kinds = check_exactly_once(pool.lines(), trained, num_groups, k)
    assert kills >= 5 and freezes >= 1, (kills, freezes)
    assert kinds["rejected"] + kinds["lost"] >= 1, kinds  # late workers were refused
    assert final["rejected:lease_lost"] >= 1 and final["lease_expiries"] >= kills
    assert final.get("slot:PENDING", 0) == 0 and final.get("slot:LEASED", 0) == 0
    assert final["slot:COMPLETE"] == num_groups * k and final.get("slot:DEAD", 0) == 0
    assert final["group:COMMITTED"] == num_groups
    assert final.get("group:READY", 0) == final.get("group:RUNNING", 0) == 0


def test_redis_killed_and_restarted_mid_run(tmp_path: Path, workers: list[Workers]) -> None:
    """Redis with AOF (appendfsync everysec) SIGKILLed mid-run and restarted on the same
    port: no group is lost or trained twice; lost writes are redone via lease expiry."""
    num_groups, k = 300, 2
    redis_process, url = start_private_redis(tmp_path / "redis-state")
    port = url.rsplit(":", 1)[1].split("/")[0]
    try:
        with reconciler(
            tmp_path, redis_url=url, extra="lease_ttl_s = 1.0\nmax_attempts = 100"
        ) as server:

            async def submit() -> None:
                async with make_channel(server.target, token=TOKEN) as channel:
                    await ReconcilerClient(channel).submit_many(
                        [spec(k=k) for _ in range(num_groups)]
                    )

            asyncio.run(submit())
            time.sleep(1.5)  # past the fsync interval: the submissions are durable
            pool = Workers(server.target, tmp_path, ttl_s=1.0)
            workers.append(pool)
            for i in range(4):
                pool.start(f"w{i}")

            trained: list[str] = []
            trained_at_kill: list[int] = []

            async def run() -> None:
                nonlocal redis_process

                async def outage() -> None:
                    nonlocal redis_process
                    while len(trained) < num_groups // 4:  # noqa: ASYNC110 - polls progress
                        await asyncio.sleep(0.05)
                    trained_at_kill.append(len(trained))
                    redis_process.popen.kill()  # type: ignore[union-attr]
                    redis_process.popen.wait()  # type: ignore[union-attr]
                    await asyncio.sleep(1.0)
                    redis_process = restart_redis(redis_process, int(port))

                fault = asyncio.create_task(outage())
                await consume_all(server, num_groups, batch=8, timeout_s=180, trained=trained)
                await fault

            asyncio.run(run())
            pool.stop_all()
            final = counts(server)
        check_exactly_once(pool.lines(), trained, num_groups, k)
        assert trained_at_kill[0] < num_groups // 2  # the outage hit mid-run
        assert final["group:COMMITTED"] == num_groups
        assert final.get("slot:PENDING", 0) == 0 and final.get("slot:LEASED", 0) == 0
    finally:
        redis_process.stop(5)


def restart_redis(old: ManagedProcess, port: int) -> ManagedProcess:
    """The same redis-server command (same port, same AOF directory) started again."""
    process = ManagedProcess(name="redis", argv=old.argv, log_path=old.log_path)
    process.start()
    deadline = time.monotonic() + 10
    while not redis_answers(f"redis://127.0.0.1:{port}/0", 0.2):
        assert time.monotonic() < deadline, "redis did not restart"
        time.sleep(0.05)
    return process


TRAINER = """
import asyncio, json, sys
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel

async def main(target, token, step, commit):
    async with make_channel(target, token=token) as channel:
        client = ReconcilerClient(channel)
        answer = await client.pull_batch("trainer", step, 3, 0, wait_s=5)
        print(json.dumps([g.group_id for g in answer.groups]), flush=True)
        if commit == "commit":
            await client.commit("trainer", step, [g.group_id for g in answer.groups])
        else:
            await asyncio.sleep(3600)  # "training": killed before it commits

asyncio.run(main(*sys.argv[1:3], int(sys.argv[3]), sys.argv[4]))
"""


def test_trainer_killed_before_commit_gets_the_same_groups(tmp_path: Path) -> None:
    with reconciler(tmp_path) as server:

        async def prepare() -> None:
            async with make_channel(server.target, token=TOKEN) as channel:
                client = ReconcilerClient(channel)
                await client.submit_many([spec(k=1) for _ in range(6)])
                for slot in await client.claim("w", 6):
                    async with client.lease(slot) as lease:
                        await lease.complete(rollout(slot.lease.slot_id))

        asyncio.run(prepare())

        def trainer(step: int, commit: str) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [sys.executable, "-c", TRAINER, server.target, TOKEN, str(step), commit],
                cwd=REPO,
                stdout=subprocess.PIPE,
                text=True,
            )

        crashed = trainer(1, "crash")
        assert crashed.stdout is not None
        first = crashed.stdout.readline()
        crashed.kill()
        crashed.wait()
        restarted = trainer(1, "commit")
        again, _ = restarted.communicate(timeout=60)
        assert json.loads(again) == json.loads(first) and len(json.loads(first)) == 3
        following = trainer(2, "commit")
        rest, _ = following.communicate(timeout=60)
        assert len(json.loads(rest)) == 3 and not set(json.loads(rest)) & set(json.loads(first))
        again_after_commit = trainer(1, "commit")
        _, _ = again_after_commit.communicate(timeout=60)
        assert again_after_commit.returncode != 0  # step 1 is committed: refused
        final = counts(server)
        assert final["group:COMMITTED"] == 6
