"""Staleness is judged once, by the reconciler: the value its staleness policy used (by
its ``staleness_anchor``) comes back on each pulled ``Group``, its histogram observes it,
and the trainer's step record reports exactly that value."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest

from services.api.v1 import common_pb2
from services.reconciler_client import ReconcilerClient
from services.trainer.job import version_provenance
from services.wire.client import make_channel
from tests.conftest import TOKEN
from tests.reconciler_support import reconciler
from tests.test_reconciler_store import rollout, task

pytestmark = pytest.mark.integration


async def _publish(client: ReconcilerClient, version: int) -> None:
    await client.publish_version(
        common_pb2.PolicyVersionNotice(
            version=version, manifest_key=f"weights/test/{version}/manifest.json"
        )
    )


def _histogram(http: str) -> tuple[float, float]:
    """(sum, count) of etude_reconciler_staleness_versions on the reconciler's /metrics."""
    with urllib.request.urlopen(f"{http}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for name in ("sum", "count"):
        match = re.search(rf"^etude_reconciler_staleness_versions_{name} (\S+)$", text, re.M)
        assert match, text
        values[name] = float(match.group(1))
    return values["sum"], values["count"]


@pytest.mark.parametrize(("anchor", "expected"), [("start", 2), ("submit", 3)])
def test_the_trainer_reports_the_reconcilers_staleness(
    tmp_path: Path, anchor: str, expected: int
) -> None:
    # Submitted under version 0, first leased under version 1, pulled by a trainer at 3:
    # 2 versions stale counted from the start, 3 from the submission.
    extra = f'staleness_anchor = "{anchor}"\nmax_staleness = 10'

    async def scenario(target: str, http: str) -> None:
        async with make_channel(target, token=TOKEN) as channel:
            client = ReconcilerClient(channel)
            future = await client.submit(task("stale"), 2)
            await _publish(client, 1)
            for slot in await client.claim("worker", max_slots=2):
                assert slot.start_policy_version == 1
                async with client.lease(slot) as lease:
                    await lease.complete(rollout(slot.lease.slot_id))
            await _publish(client, 2)
            await _publish(client, 3)
            answer = await client.pull_batch("trainer", 0, 1, current_version=3)
            (group,) = answer.groups
            assert group.group_id == future.group_id
            assert group.staleness == expected
            assert version_provenance(answer.groups)["staleness"] == [expected]
            # Pulled again (a trainer that crashed before its commit): the same value.
            again = await client.pull_batch("trainer", 0, 1, current_version=3)
            assert version_provenance(again.groups)["staleness"] == [expected]
            assert (await client.get_group(group.group_id)).staleness == expected
            # The reconciler's histogram observed the same value, once.
            assert _histogram(http) == (float(expected), 1.0)

    with reconciler(tmp_path, extra=extra) as server:
        asyncio.run(scenario(server.target, server.http))


def test_staleness_is_never_negative(tmp_path: Path) -> None:
    async def scenario(target: str) -> None:
        async with make_channel(target, token=TOKEN) as channel:
            client = ReconcilerClient(channel)
            await _publish(client, 2)
            await client.submit(task("ahead"), 2)
            for slot in await client.claim("worker", max_slots=2):
                async with client.lease(slot) as lease:
                    await lease.complete(rollout(slot.lease.slot_id))
            # A trainer behind the version the group started under (resumed from an older
            # checkpoint): the group is fresh to it, not -2 versions stale.
            (group,) = (await client.pull_batch("trainer", 0, 1, current_version=0)).groups
            assert group.start_policy_version == 2 and group.staleness == 0

    with reconciler(tmp_path, extra="max_staleness = 0") as server:
        asyncio.run(scenario(server.target))


def test_staleness_up_to_2_53_is_kept_exactly(tmp_path: Path) -> None:
    # Staleness is computed in Lua and stored as decimal text, read back as an integer
    # (never through a float): exact at 2^53 - 1, the largest version a request carries.
    current = 2**53 - 1

    async def scenario(target: str) -> None:
        async with make_channel(target, token=TOKEN) as channel:
            client = ReconcilerClient(channel)
            future = await client.submit(task("far-behind"), 2)
            for slot in await client.claim("worker", max_slots=2):
                async with client.lease(slot) as lease:
                    await lease.complete(rollout(slot.lease.slot_id))
            answer = await client.pull_batch("trainer", 0, 1, current_version=current)
            assert answer.num_stale_dropped == 1 and not answer.groups
            assert (await client.get_group(future.group_id)).staleness == current

    with reconciler(tmp_path, extra='max_staleness = 0\nstale_policy = "drop"') as server:
        asyncio.run(scenario(server.target))
