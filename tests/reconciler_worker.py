"""A rollout worker for the reconciler's fault tests (run as a process, killed at will).

Claims slots over gRPC, holds each with background heartbeats for a random short
"work" time, then completes it. Every acknowledged answer is appended to a log with
one write() per line, so a SIGKILL never leaves half a line:
``done <slot> <rollout_id> <duplicate 0|1>``, ``rejected <slot> <rollout_id>``, ``lost <slot>``.

    python -m tests.reconciler_worker --target HOST:PORT --worker-id w1 --log FILE
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random

import grpc
from grpc import aio

from services.api.v1 import common_pb2, reconciler_pb2
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel


def _log(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


async def _work(
    client: ReconcilerClient, slot: reconciler_pb2.ClaimedSlot, args: argparse.Namespace, fd: int
) -> None:
    lease = slot.lease
    rollout_id = f"{args.worker_id}-{lease.slot_id.replace('/', '-')}-{lease.attempt}"
    summary = common_pb2.RolloutSummary(
        rollout_id=rollout_id,
        group_id=lease.group_id,
        sample_index=lease.sample_index,
        record=common_pb2.ObjectRef(key=f"rollouts/{rollout_id}", sha256="0" * 64),
    )
    async with client.lease(slot) as held:
        await asyncio.sleep(random.uniform(args.work_min_s, args.work_max_s))
        if held.lost.is_set():
            _log(fd, f"lost {lease.slot_id}")
            return
        while True:
            try:
                answer = await held.complete(summary)
                _log(fd, f"done {lease.slot_id} {rollout_id} {int(answer.duplicate)}")
                return
            except aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    _log(fd, f"rejected {lease.slot_id} {rollout_id}")
                    return
                if error.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                await asyncio.sleep(
                    0.2
                )  # reconciler or Redis restarting: retry the same completion


async def main(args: argparse.Namespace) -> None:
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    async with make_channel(args.target, token=args.token, default_timeout_s=10) as channel:
        client = ReconcilerClient(channel)
        running: set[asyncio.Task[None]] = set()
        while True:
            free = args.concurrency - len(running)
            claimed = []
            if free:
                try:
                    claimed = await client.claim(args.worker_id, free, lease_ttl_s=args.ttl_s)
                except aio.AioRpcError as error:
                    if error.code() not in (
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    ):
                        raise
            for slot in claimed:
                task = asyncio.create_task(_work(client, slot, args, fd))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(0.02 if not claimed else 0)
            for task in [t for t in running if t.done() and t.exception()]:
                raise task.exception()  # type: ignore[misc]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--ttl-s", type=float, default=1.0)
    parser.add_argument("--work-min-s", type=float, default=0.02)
    parser.add_argument("--work-max-s", type=float, default=0.15)
    parser.add_argument("--concurrency", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
