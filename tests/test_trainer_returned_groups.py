"""A rollout record that fails to load fails its slot, never the training job.

The real job loop (``TrainingJob``) pulls from a real reconciler process and reads
records from a file:// object store. Of the first step's three groups one is fine, one
has a record whose bytes were damaged after its slot completed, and one has a record the
store does not serve at first (an outage). The step trains the fine group alone; the
damaged record's slot is dead with its reason and its group dropped; the unserved slot
runs again, and once the store answers the next step trains its group.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest
import torch

from services.api.v1 import reconciler_pb2
from services.config.deployment import EtudeConfig
from services.objectstore.base import ObjectStoreError
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.trainer.job import TrainingJob
from services.trainer.model import load_pretrained
from services.trainer.runtime import LocalRuntime
from services.wire.client import make_channel
from tests.conftest import TOKEN
from tests.reconciler_support import reconciler
from tests.test_trainer_learning import _records
from tests.trainer_support import complete_group, sample, segment_of, store_rollout

pytestmark = pytest.mark.integration


class OutageStore(FileObjectStore):
    """A file store that does not serve the keys in ``unserved`` (as an S3 store that
    ran out of retries answers)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.unserved: set[str] = set()

    def get(self, key: str) -> bytes:
        if key in self.unserved:
            raise ObjectStoreError(f"get {self.url}/{key}: connection refused")
        return super().get(key)


def _reward(completion: list[int]) -> float:
    return float(completion[0] % 2)


def _metric(http: str, pattern: str) -> float:
    with urllib.request.urlopen(f"{http}/metrics", timeout=5) as response:
        text = response.read().decode()
    match = re.search(rf"^{re.escape(pattern)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_bad_and_unserved_records_go_back_and_training_goes_on(
    tiny_model: Path, tmp_path: Path
) -> None:
    metrics_file = tmp_path / "rl.jsonl"
    with reconciler(tmp_path, extra="max_staleness = 10\nmax_attempts = 3") as server:
        config = EtudeConfig.model_validate(
            {
                "run": {"name": server.run_name, "state_dir": str(tmp_path / "state")},
                "object_store": {"url": f"file://{tmp_path / 'store'}"},
                "weights": {"collect_garbage": False},
                "trainer": {
                    "job": {
                        "num_threads": 1,
                        "seed": 0,
                        "phase": "rl",
                        "model": {"model_dir": str(tiny_model), "compute_dtype": "float32"},
                        "rl": {
                            "groups_per_step": 3,
                            "pull_wait_s": 1,
                            "generation_budget_tokens": 8,
                            "kl_coef": 0.0,
                        },
                        "max_steps": 2,
                        "metrics_file": str(metrics_file),
                    }
                },
            }
        )
        store = OutageStore(tmp_path / "store")
        client = ReconcilerClient(make_channel(server.target, token=TOKEN))
        policy = load_pretrained(tiny_model, dtype=torch.float32)
        prompts = [[3, 200 + g] for g in range(3) for _ in range(2)]
        samples = sample(policy, prompts, 6, torch.Generator().manual_seed(0))
        fine, damaged, unserved = [
            await complete_group(client, store, f"task-{g}", samples[2 * g : 2 * g + 2], _reward)
            for g in range(3)
        ]
        (store.root / f"rollouts/test/{damaged}/1.pb").write_bytes(b"not a record")
        store.unserved.add(f"rollouts/test/{unserved}/0.pb")

        job = await asyncio.to_thread(TrainingJob.build, config, store, client, LocalRuntime())
        training = asyncio.create_task(job.run())
        # The outage ends once the trainer has handed the slot back; then a worker runs it.
        while (await client.get_group(unserved)).slots[
            0
        ].state != reconciler_pb2.SLOT_STATE_PENDING:
            assert not training.done(), job.error
            await asyncio.sleep(0.05)
        store.unserved.clear()
        (slot,) = await client.claim("worker", max_slots=4)
        assert slot.lease.slot_id == f"{unserved}/0" and slot.lease.attempt == 2
        summary = store_rollout(store, unserved, 0, [segment_of(samples[4])], 1.0)
        async with client.lease(slot) as lease:
            await lease.complete(summary)
        await asyncio.wait_for(training, 300)
        assert job.state == "done", job.error

        first, second = _records(metrics_file)
        assert first["group_ids"] == [fine] and first["groups"] == 1.0
        assert first["skipped_group_returned"] == 2.0
        assert first["skipped_rollout_record_corrupt"] == 1.0
        assert first["skipped_rollout_store_unavailable"] == 1.0
        assert first["grad_norm"] > 0  # the fine group trained
        assert second["group_ids"] == [unserved] and second["groups"] == 1.0
        assert "skipped_group_returned" not in second

        group = await client.get_group(damaged)
        assert group.state == reconciler_pb2.GROUP_STATE_DROPPED
        assert group.slots[1].state == reconciler_pb2.SLOT_STATE_DEAD
        assert group.slots[1].last_failure == "trainer: record_corrupt"
        group = await client.get_group(unserved)
        assert group.state == reconciler_pb2.GROUP_STATE_COMMITTED
        assert group.slots[0].attempts == 2
        assert group.slots[0].last_failure == "trainer: store_unavailable"
        assert (await client.get_group(fine)).state == reconciler_pb2.GROUP_STATE_COMMITTED

        dead = 'etude_reconciler_dead_slots_total{reason="trainer: record_corrupt"}'
        requeued = 'etude_reconciler_returned_slots_total{action="requeued"}'
        deadline = asyncio.get_running_loop().time() + 10  # the snapshot refreshes
        while _metric(server.http, dead) != 1.0 or _metric(server.http, requeued) != 1.0:
            assert asyncio.get_running_loop().time() < deadline, "metrics never showed it"
            await asyncio.sleep(0.2)
