"""The harness and the rollout worker through real inference (vLLM, tiny model) and a
real reconciler: multi-turn, forced self-summarization, consistent records."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services import routed_experts
from services.api.v1 import common_pb2, reconciler_pb2
from services.config.envs import FamilyBudgets, HarnessConfig, RewardConfig, SandboxConfig
from services.envs.grading import grade
from services.envs.harness import Harness
from services.envs.inference_client import InferenceGenerator
from services.envs.sandbox import make_sandbox
from services.envs.tools import Tools
from services.envs.worker import RolloutWorker
from services.envs.workspace import Workspaces
from services.objectstore.local import FileObjectStore
from services.reconciler_client import ReconcilerClient
from services.wire.client import make_channel
from tests.conftest import TOKEN, Deployment
from tests.reconciler_support import reconciler

pytestmark = pytest.mark.integration
SUMMARY_CLOSERS = {0, 6, 15}  # <|endoftext|>, <|end_of_turn|>, <|/summary|>


@pytest.fixture
def workspaces() -> Iterator[Workspaces]:
    root = Path(tempfile.mkdtemp(prefix="etude-ws-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield Workspaces(root, make_sandbox(SandboxConfig(wall_s=10)))
    finally:
        for directory, _, _ in os.walk(root):
            os.chmod(directory, 0o755)
        shutil.rmtree(root)


def task() -> common_pb2.Task:
    return common_pb2.Task(
        task_id="harness/0",
        family="synthetic",
        instruction="Write add_one(x) in solution.py so that add_one(2) == 3.",
        files=[
            common_pb2.WorkspaceFile(path="solution.py", content=b"def add_one(x):\n    pass\n")
        ],
        grading=common_pb2.GradingSpec(
            command=["python3", "-c", "import solution; assert solution.add_one(2) == 3"],
            timeout_s=10,
            reward_mode=common_pb2.REWARD_MODE_ALL_PASS,
        ),
    )


def check_segment(segment: common_pb2.Segment, layers: int, top_k: int) -> int:
    """The invariants of a stored segment; returns its generated-token count."""
    after_prompt = len(segment.token_ids) - segment.num_prompt_tokens
    mask = list(segment.generated_mask)
    assert len(segment.logprobs) == after_prompt == len(mask)
    generated = [i for i, m in enumerate(mask) if m]
    assert all(segment.logprobs[i] < 0 for i in generated)
    assert all(segment.logprobs[i] == 0 for i, m in enumerate(mask) if not m)
    spans = [(s.start, s.end) for s in segment.version_spans]
    covered = sorted(i for start, end in spans for i in range(start, end))
    assert covered == generated  # every generated token has a version, and nothing else
    routing = routed_experts.decode(segment.routed_experts, len(segment.token_ids))
    # A row for every token the engine ran: all but the final generated token, which was
    # never fed back.
    assert routing is not None and routing.shape == (len(segment.token_ids) - 1, layers, top_k)
    assert np.all((routing >= 0) & (routing < 8))
    return len(generated)


def test_multi_turn_rollout_with_forced_summary(
    deployment: Deployment, tiny_model: Path, workspaces: Workspaces
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    opening = len(
        Harness(InferenceGenerator.__call__, tokenizer, HarnessConfig()).prompt(
            task().instruction, []
        )
    )  # type: ignore[arg-type]
    config = HarnessConfig(
        max_turns=8,
        max_tokens_per_turn=24,
        context_tokens=opening + 150,  # room for about two turns: the third needs a summary
        max_summaries=1,
        summary_tokens=12,
        max_tool_output_tokens=24,
        require_finish=True,  # the untrained model never calls a tool: keep it talking
    )
    workspace = workspaces.create(task())

    async def run() -> object:
        async with make_channel(deployment.target("inference"), token=TOKEN) as channel:
            tools = Tools(
                workspaces,
                workspace.workspace_id,
                lambda ws: grade(workspaces, ws, task().grading),
                5,
            )
            return await Harness(InferenceGenerator(channel, 1.0, seed=3), tokenizer, config).run(
                task(), tools
            )

    result = asyncio.run(run())
    assert result.stats.num_summaries == 1 and len(result.segments) == 2  # type: ignore[attr-defined]
    first, second = result.segments  # type: ignore[attr-defined]
    assert (
        first.kind == common_pb2.SEGMENT_KIND_SUMMARY
        and second.kind == common_pb2.SEGMENT_KIND_MAIN
    )
    generated = sum(check_segment(s, layers=2, top_k=2) for s in result.segments)  # type: ignore[attr-defined]
    assert generated == result.stats.num_generated_tokens  # type: ignore[attr-defined]
    assert result.stats.num_turns >= 2  # type: ignore[attr-defined]
    # The summary's own token ids open the next context (token-in, token-out).
    tail = first.token_ids[first.num_prompt_tokens :]
    last_span = first.version_spans[-1]  # the summary was the segment's last generation
    summary = [t for t in tail[last_span.start : last_span.end] if t not in SUMMARY_CLOSERS]
    prompt = list(second.token_ids[: second.num_prompt_tokens])
    assert summary and any(prompt[i : i + len(summary)] == summary for i in range(len(prompt)))
    assert result.finish_reason in ("turn_budget", "context_full", "token_budget")  # type: ignore[attr-defined]


def test_worker_completes_slots_with_stored_records(
    deployment: Deployment, tiny_model: Path, workspaces: Workspaces, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    store = FileObjectStore(tmp_path / "store")
    with reconciler(tmp_path) as control:

        async def run() -> reconciler_pb2.Group:
            async with (
                make_channel(control.target, token=TOKEN) as control_channel,
                make_channel(deployment.target("inference"), token=TOKEN) as inference_channel,
            ):
                client = ReconcilerClient(control_channel)
                worker = RolloutWorker(
                    worker_id="test-worker",
                    reconciler=client,
                    inference=inference_channel,
                    workspaces=workspaces,
                    store=store,
                    tokenizer=AutoTokenizer.from_pretrained(tiny_model),
                    grade=grade,
                    run_name="test",
                    # The task's family writes at most 8 tokens a turn (its own budget).
                    harness=HarnessConfig(
                        max_turns=2,
                        max_tokens_per_turn=16,
                        families={
                            "synthetic": FamilyBudgets(max_tokens_per_turn=8),
                            "multifile": FamilyBudgets(max_tokens_per_turn=32),
                        },
                    ),
                    rewards=RewardConfig(),
                    lease_ttl_s=30,
                )
                future = await client.submit(task(), 3)
                running = asyncio.create_task(worker.run(concurrency=2, idle_s=0.1))
                try:
                    async with asyncio.timeout(120):
                        return await future.result()
                finally:
                    running.cancel()

        group = asyncio.run(run())
    assert len(group.rollouts) == 3
    for summary in group.rollouts:
        record = common_pb2.RolloutRecord.FromString(store.get(summary.record.key))
        assert record.summary.rollout_id == summary.rollout_id
        assert record.summary.reward.total == pytest.approx(summary.reward.total)
        parts = summary.reward
        assert parts.total == pytest.approx(parts.task + parts.length_penalty + parts.behaviour)
        assert parts.task == summary.grade.score == 0.0  # the untrained model does not solve it
        assert summary.grade.failure_reason or summary.grade.num_tests >= 1
        assert summary.stats.num_generated_tokens <= 8 * summary.stats.num_turns
        for segment in record.segments:
            check_segment(segment, layers=2, top_k=2)
    # Every workspace was cleaned up; the group's snapshot is kept for reuse.
    assert list((workspaces.root / "workspaces").iterdir()) == []


def test_a_family_has_its_own_budgets() -> None:
    harness = HarnessConfig(
        max_turns=4,
        context_tokens=2048,
        families={"multifile": FamilyBudgets(max_turns=12, context_tokens=1536)},
    )
    multifile = harness.for_family("multifile")
    assert (multifile.max_turns, multifile.context_tokens) == (12, 1536)
    assert multifile.max_total_tokens == harness.max_total_tokens  # not set: the harness's
    assert multifile.families == {}
    assert harness.for_family("synthetic") == harness.model_copy(update={"families": {}})
    with pytest.raises(ValueError, match="not a family name"):
        HarnessConfig(families={"no spaces": FamilyBudgets()})
    with pytest.raises(ValueError, match="max_turns"):
        FamilyBudgets(max_turns=0)
