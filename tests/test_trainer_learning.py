"""Learning sanity on CPU: SFT lowers the loss; RL on a learnable reward raises it.

Both run the real job loop (``TrainingJob``) in-process; RL pulls its groups from a
real reconciler process and reads rollout records from a file:// object store, while
the test plays the envs worker: it samples with the newest published policy (loaded
through ``WeightSubscriber``), scores, stores records and completes the slots.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.api.v1 import reconciler_pb2
from services.config.deployment import EtudeConfig
from services.model_factory.corpus import snippet
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.trainer.job import TrainingJob
from services.trainer.model import from_hf, load_pretrained
from services.trainer.runtime import LocalRuntime
from services.weights.subscriber import WeightSubscriber
from services.wire.client import make_channel
from tests.conftest import TOKEN
from tests.reconciler_support import reconciler
from tests.trainer_support import complete_group, sample


def _config(tmp_path: Path, job: dict[str, Any], run: str = "learn") -> EtudeConfig:
    return EtudeConfig.model_validate(
        {
            "run": {"name": run, "state_dir": str(tmp_path / "state")},
            "object_store": {"url": f"file://{tmp_path / 'store'}"},
            "weights": {"collect_garbage": False},
            "trainer": {"job": {"num_threads": 1, "seed": 0, **job}},
        }
    )


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_sft_lowers_the_loss_on_a_synthetic_task_corpus(
    tiny_model: Path, tmp_path: Path
) -> None:
    rng = random.Random(0)
    data = tmp_path / "tasks.jsonl"
    with data.open("w") as out:
        for _ in range(1500):
            item = snippet(rng)
            out.write(
                json.dumps(
                    {
                        "prompt": f"<|user|>{item.call}<|end_of_turn|><|assistant|>",
                        "completion": f"{item.expected}<|end_of_turn|>",
                    }
                )
                + "\n"
            )
    metrics_file = tmp_path / "sft.jsonl"
    config = _config(
        tmp_path,
        {
            "phase": "sft",
            "model": {"model_dir": str(tiny_model), "compute_dtype": "float32"},
            "data": {"kind": "jsonl", "path": str(data), "tokens_per_step": 768, "max_seq_len": 96},
            "optimizer": {"lr": 3e-3},
            "max_steps": 30,
            "checkpoint": {"interval_steps": 10},
            "publish_interval_steps": 0,
            "export_dir": str(tmp_path / "sft-model"),
            "metrics_file": str(metrics_file),
        },
    )
    store = FileObjectStore(tmp_path / "store")
    job = await asyncio.to_thread(TrainingJob.build, config, store, None, LocalRuntime())
    await job.run()
    assert job.state == "done", job.error
    losses = [r["loss"] for r in _records(metrics_file)]
    assert len(losses) == 30
    # From ~ln(1024) = 6.9 (uniform) to well below: the completions are learnable.
    assert sum(losses[-5:]) / 5 < losses[0] - 2.5, losses
    assert [c.step for c in job.checkpoints.list()] == [10, 20, 30]
    exported = load_pretrained(tmp_path / "sft-model", dtype=torch.float32)
    assert torch.equal(exported.lm_head.weight, job.learner.model.lm_head.weight.bfloat16().float())


TARGET = set(range(16, 144))  # 128 of the 1024 vocabulary rows: ~1/8 of uniform samples


class SlowFirstStep(ReconcilerClient):
    """Answers the first step's first two pulls empty after 3 s each, as waits that end
    with nothing ready do. The test has completed the step's groups by then, so the
    third pull answers at once: only a ``time_wait_s`` that counts the empty pulls
    reaches 6 s."""

    empty_pulls = 2

    async def pull_batch(
        self, consumer_id: str, step: int, num_groups: int, current_version: int, wait_s: float = 0
    ) -> reconciler_pb2.PullBatchResponse:
        if step == 0 and self.empty_pulls:
            self.empty_pulls -= 1
            await asyncio.sleep(3.0)
            return reconciler_pb2.PullBatchResponse()
        return await super().pull_batch(consumer_id, step, num_groups, current_version, wait_s)


def _reward(completion: list[int]) -> float:
    return sum(token in TARGET for token in completion) / len(completion)


@pytest.mark.slow
async def test_rl_raises_the_mean_reward(tiny_model: Path, tmp_path: Path) -> None:
    steps, groups_per_step, group_size = 24, 4, 4
    metrics_file = tmp_path / "rl.jsonl"
    with reconciler(tmp_path, extra="max_staleness = 4") as server:
        config = _config(
            tmp_path,
            {
                "phase": "rl",
                "model": {"model_dir": str(tiny_model), "compute_dtype": "float32"},
                "optimizer": {"lr": 2e-2},
                "rl": {
                    "groups_per_step": groups_per_step,
                    # Every step waits for its four groups: with a short wait a slow machine
                    # gets a partial batch, the trainer steps ahead, and the rest of the
                    # groups train one version stale (importance ratios far from 1).
                    "pull_wait_s": 60,
                    "generation_budget_tokens": 8,
                    "kl_coef": 0.001,
                    "reference_refresh_steps": 5,
                },
                "max_steps": steps,
                "checkpoint": {"interval_steps": 4},
                "metrics_file": str(metrics_file),
            },
            run=server.run_name,
        )
        store = FileObjectStore(tmp_path / "store")
        client = SlowFirstStep(make_channel(server.target, token=TOKEN))
        job = await asyncio.to_thread(TrainingJob.build, config, store, client, LocalRuntime())
        training = asyncio.create_task(job.run())
        policy = load_pretrained(tiny_model, dtype=torch.float32)
        subscriber = WeightSubscriber(store, server.run_name, config.weights)
        generator = torch.Generator().manual_seed(0)
        for step in range(steps):
            if step:
                while job.last_published_version < step:
                    assert not training.done(), job.error
                    await asyncio.sleep(0.05)
                weights = await asyncio.to_thread(subscriber.load, step)
                policy.load_state_dict(from_hf(weights, policy.arch))
            prompts = [[3, 200 + step * groups_per_step + g] for g in range(groups_per_step)]
            samples = await asyncio.to_thread(
                sample, policy, [p for p in prompts for _ in range(group_size)], 6, generator
            )
            for g in range(groups_per_step):
                chunk = samples[g * group_size : (g + 1) * group_size]
                await complete_group(client, store, f"task-{step}-{g}", chunk, _reward)
        await asyncio.wait_for(training, 120)
        assert job.state == "done", job.error
    records = _records(metrics_file)
    rewards = [r["reward_total_mean"] for r in records]
    assert len(rewards) == steps
    assert all(r["groups"] == groups_per_step for r in records), [r["groups"] for r in records]
    assert records[0]["time_wait_s"] >= 6.0, records[0]["time_wait_s"]  # both empty pulls
    # Measured (float32 experts): ~0.11 over the first three steps, 0.45 at step 16 and
    # ~0.94 over the last three.
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    # The reference is the start policy, then the policy of every fifth step: the first
    # step after a refresh measures the KL against the very weights it starts from.
    kls = [r["kl"] for r in records]
    assert kls[0] == kls[5] == kls[10] == kls[15] == 0.0
    assert all(kl != 0.0 for i, kl in enumerate(kls) if i % 5), kls
    # The sampler's routes were replayed, and the importance ratios stayed near 1.
    replayed = [r["replay_token_fraction"] for r in records]
    assert all(fraction == 1.0 for fraction in replayed), replayed
    ratios = [r["is_ratio_mean"] for r in records]
    assert all(0.9 < ratio < 1.1 for ratio in ratios), ratios
