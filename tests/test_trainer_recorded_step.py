"""Recorded steps: one RL step and one SFT step, on the learner and through the training
job, give exactly the losses, metrics and updated weights recorded in
``tests/fixtures/recorded_steps.json``.

The first record was made before the trainer's loops were restructured, so this test
says a change of structure changed no number. Everything is seeded and runs float32 on
one thread; timings are left out. CPUs round float32 differently (their SIMD paths sum
in other orders), so the record is kept per rounding signature: a CPU is held to a
record exactly (its own, or another it matches bit for bit), and one that matches none
and has none to float32 accuracy. ``ETUDE_RECORD_STEPS=1`` writes
this CPU's record (only on a commit whose numbers are trusted, e.g. one that another
record already matches exactly on its own CPU).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.deployment import EtudeConfig
from services.config.trainer import JobConfig
from services.objectstore.local import FileObjectStore
from services.trainer.batch import RLBatch, TrainItem, pack_microbatch
from services.trainer.job import TrainingJob
from services.trainer.learner import Learner
from services.trainer.model import Qwen3MoE, load_pretrained
from services.trainer.rollouts import SegmentTokens
from services.trainer.runtime import LocalRuntime
from services.trainer.sft import Example, to_microbatch
from tests.trainer_support import (
    one_thread,  # noqa: F401  (autouse: one torch thread)
    sample,
    segment_of,
    store_rollout,
)

FIXTURE = Path(__file__).parent / "fixtures" / "recorded_steps.json"
TIMINGS = ("time_", "tokens_per_s")


def checksum(model: Qwen3MoE) -> str:
    """sha256 of every tensor of the model's state, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(metrics.items()) if not k.startswith(TIMINGS)}


def rounding_signature() -> str:
    """Names how this CPU's float32 kernels round (one thread): a matmul, its backward, a
    softmax and a norm on fixed inputs, hashed. Machines whose SIMD paths differ (AVX-512,
    AMX, AVX2) round float32 sums in different orders, and so train other last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(37, 96, generator=generator, requires_grad=True)
        b = torch.randn(96, 61, generator=generator)
        out = torch.softmax(a @ b, dim=-1)
        loss = torch.nn.functional.rms_norm(out, (61,)).square().sum()
        loss.backward()
        assert a.grad is not None
        data = torch.cat([out.flatten(), a.grad.flatten(), loss.reshape(1)]).detach()
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]
    finally:
        torch.set_num_threads(threads)


def records() -> dict[str, dict[str, Any]]:
    """The recorded steps by rounding signature (``"first"``: the original record, made
    before the trainer's loops were restructured, on a CPU whose signature it did not keep)."""
    return dict(json.loads(FIXTURE.read_text())["by_signature"])


def assert_reproduces(steps: dict[str, dict[str, Any]]) -> None:
    """``steps`` are a record exactly: this CPU's own record, or another record they
    match bit for bit (two CPUs can share the float32 probe's signature and still round
    a training step differently: a 2-core Xeon with AMX shares the EPYC's signature and
    reproduces the Xeon-made first record). A CPU that matches none is held to its own
    record when there is one, else to float32 accuracy on every recorded metric of the
    first record (its weights' last bits differ)."""
    recorded = records()
    own = recorded.get(rounding_signature())
    candidates = ([own] if own is not None else []) + [
        record for record in recorded.values() if record is not own
    ]
    for record in candidates:
        if all(as_recorded(steps[name], record[name]) == record[name] for name in steps):
            return
    if own is not None:
        for name in steps:
            assert as_recorded(steps[name], own[name]) == own[name], name
    first = recorded["first"]
    print(f"no record for rounding signature {rounding_signature()}: float32 accuracy only")
    for name, step in steps.items():
        expected = first[name]["metrics"]
        metrics = as_recorded(step, first[name])["metrics"]
        assert metrics == pytest.approx(expected, rel=1e-4, abs=1e-6), name
        others = {k: v for k, v in step.items() if k not in ("metrics", "weights")}
        assert others == {k: v for k, v in first[name].items() if k not in ("metrics", "weights")}


def as_recorded(step: dict[str, Any], recorded: dict[str, Any]) -> dict[str, Any]:
    """``step`` with only the metrics the record names: figures added since it was made
    (the off-policy version-lag figures) are no number of the record, and a recorded
    metric that went missing still fails the comparison."""
    metrics = {k: v for k, v in step["metrics"].items() if k in recorded["metrics"]}
    return step | {"metrics": metrics}


def rl_items(seed: int) -> list[TrainItem]:
    """Sequences with prompts, replayed routes on most (some implausible), advantages."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for index, length in enumerate((23, 9, 40, 17, 31)):
        tokens = torch.randint(16, 900, (length + 1,), generator=generator).tolist()
        replay = None
        if index % 3 != 2:
            replay = torch.randint(0, 8, (length, 2, 2), generator=generator)
        segment = SegmentTokens(
            input_ids=tokens[:-1],
            targets=tokens[1:],
            trained=[position >= length // 3 for position in range(length)],
            behaviour_logprobs=(-4 - torch.rand(length, generator=generator)).tolist(),
            replay=replay,
        )
        items.append((segment, float(index % 3) - 1.0, 1.0 - 0.25 * (index % 2)))
    return items


def learner_rl(model_dir: Path, model: dict[str, Any] | None = None) -> dict[str, Any]:
    """The recorded RL step on the learner; ``model`` adds model settings to the job."""
    job = JobConfig.model_validate(
        {
            "phase": "rl",
            "model": {"compute_dtype": "float32", **(model or {})},
            "optimizer": {"lr": 1e-3, "max_grad_norm": 0.5},
            "rl": {"kl_coef": 0.01, "generation_budget_tokens": 32},
        }
    )
    torch.manual_seed(0)
    learner = Learner.load(model_dir, job)
    items = rl_items(1)
    microbatches = [pack_microbatch(items[:2], 2, 2), pack_microbatch(items[2:], 2, 2)]
    metrics = learner.rl_step(RLBatch(microbatches, 4, [], [], []), 0)
    return {"metrics": untimed(metrics), "weights": checksum(learner.model)}


def learner_sft(model_dir: Path, model: dict[str, Any] | None = None) -> dict[str, Any]:
    """The recorded SFT step on the learner; ``model`` adds model settings to the job."""
    job = JobConfig.model_validate(
        {
            "phase": "cpt",
            "data": {"kind": "corpus"},
            "model": {"compute_dtype": "float32", **(model or {})},
            "optimizer": {"lr": 1e-3, "warmup_steps": 2},
        }
    )
    torch.manual_seed(0)
    learner = Learner.load(model_dir, job)
    generator = torch.Generator().manual_seed(2)
    examples = []
    for length in (20, 33, 12):
        tokens = torch.randint(16, 900, (length,), generator=generator).tolist()
        examples.append(Example(tokens, [position >= 4 for position in range(length)]))
    metrics = learner.sft_step([to_microbatch(examples)], 1)
    return {"metrics": untimed(metrics), "weights": checksum(learner.model)}


class RecordedReconciler:
    """Plays the reconciler's side of one step: the same groups for every pull, commits
    and version notices noted. (The real one is tested as a server elsewhere; this record
    is of the trainer alone.)"""

    def __init__(self, groups: list[reconciler_pb2.Group]) -> None:
        self.groups = groups
        self.commits: list[tuple[int, list[str]]] = []
        self.versions: list[int] = []

    async def pull_batch(
        self, consumer_id: str, step: int, num_groups: int, current_version: int, wait_s: float = 0
    ) -> reconciler_pb2.PullBatchResponse:
        return reconciler_pb2.PullBatchResponse(groups=self.groups[:num_groups])

    async def commit(self, consumer_id: str, step: int, group_ids: list[str]) -> int:
        self.commits.append((step, list(group_ids)))
        return len(group_ids)

    async def publish_version(self, notice: common_pb2.PolicyVersionNotice) -> int:
        self.versions.append(notice.version)
        return notice.version


def run_config(root: Path, job: dict[str, Any]) -> EtudeConfig:
    return EtudeConfig.model_validate(
        {
            "run": {"name": "recorded", "state_dir": str(root / "state")},
            "object_store": {"url": f"file://{root / 'store'}"},
            "trainer": {"job": {"num_threads": 1, "max_steps": 1, **job}},
        }
    )


def job_rl(model_dir: Path, root: Path) -> dict[str, Any]:
    store = FileObjectStore(root / "store")
    policy = load_pretrained(model_dir, dtype=torch.float32)
    prompts = [[3, 300 + g, 40 + g] for g in range(2) for _ in range(4)]
    samples = sample(policy, prompts, 6, torch.Generator().manual_seed(3))
    groups = []
    for g in range(2):
        group_id = f"group-{g}"
        summaries = [
            store_rollout(store, group_id, i, [segment_of(s)], sum(t < 300 for t in s.completion))
            for i, s in enumerate(samples[4 * g : 4 * g + 4])
        ]
        groups.append(reconciler_pb2.Group(group_id=group_id, rollouts=summaries, weight=1.0))
    reconciler = RecordedReconciler(groups)
    config = run_config(
        root,
        {
            "phase": "rl",
            "model": {"model_dir": str(model_dir), "compute_dtype": "float32"},
            "optimizer": {"lr": 1e-3},
            "rl": {
                "groups_per_step": 2,
                "pull_wait_s": 0.1,
                "generation_budget_tokens": 8,
                "kl_coef": 0.01,
                "microbatch_tokens": 24,
            },
        },
    )
    job = TrainingJob.build(config, store, reconciler, LocalRuntime())  # type: ignore[arg-type]
    asyncio.run(job.run())
    assert job.state == "done", job.error
    return {
        "metrics": untimed(job.metrics),
        "weights": checksum(job.learner.model),
        "commits": reconciler.commits,
        "versions": reconciler.versions,
    }


def job_sft(model_dir: Path, root: Path) -> dict[str, Any]:
    root.mkdir()
    data = root / "data.jsonl"
    lines = [
        {"prompt": f"def f{i}(x):\n", "completion": f"    return x * {i} + {i * i}\n"}
        for i in range(12)
    ]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = run_config(
        root,
        {
            "phase": "sft",
            "model": {"model_dir": str(model_dir), "compute_dtype": "float32"},
            "optimizer": {"lr": 1e-3},
            "data": {"kind": "jsonl", "path": str(data), "tokens_per_step": 128, "max_seq_len": 64},
        },
    )
    job = TrainingJob.build(config, FileObjectStore(root / "store"), None, LocalRuntime())
    asyncio.run(job.run())
    assert job.state == "done", job.error
    return {
        "metrics": untimed(job.metrics),
        "weights": checksum(job.learner.model),
        "cursor": job.cursor,
    }


def test_recorded_steps_are_reproduced_exactly(tiny_model: Path, tmp_path: Path) -> None:
    steps = {
        "learner_rl": learner_rl(tiny_model),
        "learner_sft": learner_sft(tiny_model),
        "job_rl": job_rl(tiny_model, tmp_path / "rl"),
        "job_sft": job_sft(tiny_model, tmp_path / "sft"),
    }
    steps = json.loads(json.dumps(steps))  # tuples as lists, as the record holds them
    if os.environ.get("ETUDE_RECORD_STEPS") == "1":  # this CPU's record, the others kept
        recorded = records() | {rounding_signature(): steps}
        FIXTURE.write_text(json.dumps({"by_signature": recorded}, indent=1, sort_keys=True) + "\n")
    assert steps["job_rl"]["metrics"]["grad_norm"] > 0, "the step trained something"
    assert_reproduces(steps)
