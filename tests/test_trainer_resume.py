"""Exact resume: a trainer process killed (SIGKILL) between steps and restarted trains the
same steps into the same weights as an uninterrupted one, and no group twice. Also the
trainer's API while a job runs: status, tagged checkpoints, the list of checkpoints."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from services.api.v1 import common_pb2, reconciler_pb2, trainer_pb2, trainer_pb2_grpc
from services.config.trainer import JobConfig
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.trainer.checkpoint import CheckpointStore
from services.trainer.learner import Learner
from services.trainer.model import load_pretrained
from services.wire.client import make_channel
from tests.conftest import TOKEN, stop_process, wait_ready
from tests.reconciler_support import reconciler
from tests.trainer_support import (
    Sample,
    complete_group,
    sample,
    start_trainer,
    write_trainer_config,
)

AUTH = (("authorization", f"Bearer {TOKEN}"),)
STEPS, GROUPS_PER_STEP, GROUP_SIZE = 4, 2, 4


def _job_toml(model_dir: Path, metrics_file: Path) -> str:
    return "\n".join(
        [
            'phase = "rl"',
            f"max_steps = {STEPS}",
            "num_threads = 1",
            f'metrics_file = "{metrics_file}"',
            "[trainer.job.model]",
            f'model_dir = "{model_dir}"',
            'compute_dtype = "float32"',
            "[trainer.job.optimizer]",
            "lr = 0.01",
            "[trainer.job.rl]",
            f"groups_per_step = {GROUPS_PER_STEP}",
            "pull_wait_s = 0.2",
            "generation_budget_tokens = 8",
            "kl_coef = 0.01",
            "[trainer.job.checkpoint]",
            "interval_steps = 1",
        ]
    )


@pytest.fixture(scope="module")
def samples(tiny_model: Path) -> list[Sample]:
    policy = load_pretrained(tiny_model, dtype=torch.float32)
    prompts = [[3, 300 + g] for g in range(STEPS * GROUPS_PER_STEP) for _ in range(GROUP_SIZE)]
    return sample(policy, prompts, 5, torch.Generator().manual_seed(0))


def _reward(completion: list[int]) -> float:
    return sum(token < 300 for token in completion) / len(completion)


async def _fill(target: str, root: Path, samples: list[Sample]) -> list[str]:
    """Completes every group in a fixed order, as envs workers would; returns the task ids."""
    store = FileObjectStore(root / "store")
    async with make_channel(target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        for g in range(STEPS * GROUPS_PER_STEP):
            chunk = samples[g * GROUP_SIZE : (g + 1) * GROUP_SIZE]
            await complete_group(client, store, f"task-{g}", chunk, _reward)
    return [f"task-{g}" for g in range(STEPS * GROUPS_PER_STEP)]


async def _tasks_and_states(target: str, group_ids: list[str]) -> tuple[list[str], set[str]]:
    async with make_channel(target, token=TOKEN) as channel:
        client = ReconcilerClient(channel)
        groups = [await client.get_group(g) for g in group_ids]
    return [g.task.task_id for g in groups], {
        reconciler_pb2.GroupState.Name(g.state) for g in groups
    }


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(condition: Any, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def _status(target: str) -> trainer_pb2.TrainerStatusResponse:
    with grpc.insecure_channel(target) as channel:
        answer: trainer_pb2.TrainerStatusResponse = trainer_pb2_grpc.TrainerServiceStub(
            channel
        ).GetStatus(common_pb2.StatusRequest(), metadata=AUTH, timeout=10)
    return answer


def _final_weights(root: Path, run: str, tiny_model: Path) -> dict[str, torch.Tensor]:
    checkpoints = CheckpointStore(root / "state" / "checkpoints" / run)
    latest = checkpoints.latest()
    assert latest is not None and latest.step == STEPS
    job = JobConfig.model_validate(
        {"phase": "rl", "model": {"compute_dtype": "float32"}, "rl": {"kl_coef": 0.01}}
    )
    learner = Learner.load(tiny_model, job)
    checkpoints.load(latest, learner)
    return learner.model.state_dict()


def _run(
    tmp: Path, tiny_model: Path, samples: list[Sample], *, kill_after_step: int | None
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], list[str], set[str]]:
    """One training run on its own reconciler; returns per-step records (of the surviving
    attempts), final weights, the task ids trained per step and the groups' final states."""
    tmp.mkdir()
    with reconciler(tmp, extra="max_staleness = 10") as server:
        asyncio.run(_fill(server.target, tmp, samples))
        metrics_file = tmp / "metrics.jsonl"
        config = tmp / "trainer.toml"
        grpc_port, _ = write_trainer_config(
            config,
            run=server.run_name,
            reconciler_target=server.target,
            root=tmp,
            job=_job_toml(tiny_model, metrics_file),
        )
        target = f"127.0.0.1:{grpc_port}"
        log = tmp / "trainer.log"
        process = start_trainer(config, log)
        try:
            if kill_after_step is not None:
                _wait_for(
                    lambda: len(_records(metrics_file)) >= kill_after_step, 120, "step 2", log
                )
                os.kill(process.pid, signal.SIGKILL)  # no chance to save or commit anything
                process.wait()
                process = start_trainer(config, log)
            wait_ready(target, 60, process, log)
            _wait_for(lambda: _status(target).step == STEPS, 120, "the last step", log)
            status = _status(target)
            assert status.phase == "rl" and status.policy_version == STEPS
            assert status.metrics["tokens"] > 0 and "kl" in status.metrics
            _wait_for(
                lambda: _status(target).last_published_version == STEPS, 60, "publishing", log
            )
            with grpc.insecure_channel(target) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                saved = stub.SaveCheckpoint(
                    trainer_pb2.SaveCheckpointRequest(tag="after-run"), metadata=AUTH, timeout=60
                )
                listed = stub.ListCheckpoints(
                    trainer_pb2.ListCheckpointsRequest(), metadata=AUTH, timeout=10
                )
            assert saved.checkpoint.tag == "after-run" and saved.checkpoint.step == STEPS
            assert "after-run" in {c.tag for c in listed.checkpoints}
        finally:
            assert stop_process(process) == 0, log.read_text()[-4000:]
        records = _records(metrics_file)
        surviving = {record["step"]: record for record in records}  # the last attempt of a step
        group_ids = [g for step in sorted(surviving) for g in surviving[step]["group_ids"]]
        tasks, states = asyncio.run(_tasks_and_states(server.target, group_ids))
    weights = _final_weights(tmp, server.run_name, tiny_model)
    return [surviving[s] for s in sorted(surviving)], weights, tasks, states


@pytest.mark.slow
def test_a_killed_trainer_resumes_exactly(
    tiny_model: Path, samples: list[Sample], tmp_path: Path
) -> None:
    reference, reference_weights, reference_tasks, _ = _run(
        tmp_path / "uninterrupted", tiny_model, samples, kill_after_step=None
    )
    resumed, resumed_weights, resumed_tasks, states = _run(
        tmp_path / "killed", tiny_model, samples, kill_after_step=2
    )
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    # The same groups, step by step, each trained in exactly one surviving step...
    assert resumed_tasks == reference_tasks
    assert len(set(resumed_tasks)) == STEPS * GROUPS_PER_STEP
    assert states == {"GROUP_STATE_COMMITTED"}
    # ...with the same losses (bit for bit) and the same final weights and optimizer path.
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    assert [r["kl"] for r in resumed] == [r["kl"] for r in reference]
    assert resumed_weights.keys() == reference_weights.keys()
    assert all(torch.equal(resumed_weights[n], reference_weights[n]) for n in reference_weights)
    # Training moved the weights: equality is not that of two untouched models.
    assert any(r["loss_pg"] != 0 for r in reference)
