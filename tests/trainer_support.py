"""What the trainer tests share: a tiny model with decisive weights, a sampler that plays
the inference service, and the envs worker's side of a rollout (records in the object
store, slots completed through a real reconciler)."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.api.v1 import common_pb2
from services.objectstore.base import ObjectStore
from services.reconciler_client import ReconcilerClient
from services.trainer.model import PackedInputs, Qwen3MoE
from services.wire.ports import free_ports
from tests.conftest import REPO, TOKEN, service_env

Reward = Callable[[list[int]], float]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread for the test (a module that imports it): float32 sums then run in
    one order, so recorded numbers are reproduced bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sharpen_model(source: Path, out: Path, seed: int = 1) -> Path:
    """A copy of a factory model with weights of unit-scale fan-in (a router 3x sharper).

    The factory initializes with std 0.02, so every distribution is nearly uniform and
    parity checks would pass trivially; these weights give peaked next-token and
    router distributions, as a trained model has.
    """
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in sorted(load_file(source / "model.safetensors").items()):
        if tensor.dim() >= 2:
            scale = (3.0 if name.endswith("mlp.gate.weight") else 1.0) / math.sqrt(tensor.shape[-1])
            value = torch.randn(tensor.shape, generator=generator) * scale
        else:
            value = 1 + 0.1 * torch.randn(tensor.shape, generator=generator)
        tensors[name] = value.to(torch.bfloat16).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@dataclass
class Sample:
    """One sampled completion, as inference reports it."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    routed_experts: torch.Tensor  # [len(prompt) + len(completion), layers, k]


@torch.no_grad()
def sample(
    model: Qwen3MoE,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> list[Sample]:
    """Samples a completion of every prompt (recomputing the whole stream per token)."""
    sequences = [list(p) for p in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        inputs = PackedInputs.pack(sequences)
        output = model(inputs)
        last = torch.tensor(inputs.cu_seqlens[1:]) - 1
        log_probs = torch.log_softmax(model.logits(output.hidden[last]) / temperature, dim=-1)
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator)[:, 0]
        for index, token in enumerate(tokens.tolist()):
            sequences[index].append(token)
            logprobs[index].append(float(log_probs[index, token]))
    # The routing of every token, as inference reports it (prefill and decode alike).
    routes = model(PackedInputs.pack(sequences)).experts
    starts = PackedInputs.pack(sequences).cu_seqlens
    return [
        Sample(list(prompt), sequence[len(prompt) :], lps, routes[start : start + len(sequence)])
        for prompt, sequence, lps, start in zip(prompts, sequences, logprobs, starts, strict=False)
    ]


def routed_experts_message(routes: torch.Tensor) -> common_pb2.RoutedExperts:
    """``[tokens, layers, k]`` expert ids packed as the inference service packs them."""
    return common_pb2.RoutedExperts(
        data=routes.to(torch.uint8).numpy().tobytes(),
        shape=list(routes.shape),
        dtype=common_pb2.INDEX_DTYPE_UINT8,
    )


def segment_of(item: Sample) -> common_pb2.Segment:
    """A single-segment record's segment: prompt, then generated tokens."""
    return common_pb2.Segment(
        kind=common_pb2.SEGMENT_KIND_MAIN,
        token_ids=item.prompt + item.completion,
        num_prompt_tokens=len(item.prompt),
        logprobs=item.logprobs,
        generated_mask=bytes([1] * len(item.completion)),
        routed_experts=routed_experts_message(item.routed_experts),
        version_spans=[common_pb2.VersionSpan(version=0, start=0, end=len(item.completion))],
    )


def store_rollout(
    store: ObjectStore,
    group_id: str,
    sample_index: int,
    segments: Sequence[common_pb2.Segment],
    reward: float,
) -> common_pb2.RolloutSummary:
    """Writes the record to the store; returns the summary a worker completes a slot with."""
    rollout_id = f"{group_id}-{sample_index}-{uuid.uuid4().hex[:6]}"
    summary = common_pb2.RolloutSummary(
        rollout_id=rollout_id,
        group_id=group_id,
        sample_index=sample_index,
        reward=common_pb2.RewardParts(task=reward, total=reward),
        finish_reason="finished",
    )
    record = common_pb2.RolloutRecord(summary=summary, segments=segments)
    info = store.put(f"rollouts/test/{group_id}/{sample_index}.pb", record.SerializeToString())
    summary.record.CopyFrom(
        common_pb2.ObjectRef(key=info.key, size_bytes=info.size, sha256=info.sha256)
    )
    return summary


async def complete_group(
    client: ReconcilerClient,
    store: ObjectStore,
    task_id: str,
    samples: Sequence[Sample],
    reward: Reward,
) -> str:
    """Submits a group of len(samples) slots, claims and completes them; returns its id."""
    task = common_pb2.Task(
        task_id=task_id, family="test", grading=common_pb2.GradingSpec(command=["true"])
    )
    future = await client.submit(task, len(samples))
    claimed = await client.claim(f"worker-{task_id}", max_slots=len(samples))
    assert len(claimed) == len(samples), "another group's slots were pending"
    for slot in sorted(claimed, key=lambda c: c.lease.sample_index):
        item = samples[slot.lease.sample_index]
        summary = store_rollout(
            store,
            slot.lease.group_id,
            slot.lease.sample_index,
            [segment_of(item)],
            reward(item.completion),
        )
        async with client.lease(slot) as lease:
            await lease.complete(summary)
    return future.group_id


def write_trainer_config(
    path: Path, *, run: str, reconciler_target: str, root: Path, job: str | None
) -> tuple[int, int]:
    """A run config for one trainer process on free ports; ``job`` is TOML for [trainer.job]
    (None: no job, the trainer idles)."""
    grpc_port, http_port = free_ports(2)
    path.write_text(
        f'[run]\nname = "{run}"\nstate_dir = "{root / "state"}"\n'
        f'[object_store]\nurl = "file://{root / "store"}"\n'
        f'[endpoints]\nreconciler = "{reconciler_target}"\n'
        "[trainer]\nreadiness_interval_s = 0.5\n"
        f'grpc = {{ host = "127.0.0.1", port = {grpc_port}, shutdown_grace_s = 5 }}\n'
        f'http = {{ host = "127.0.0.1", port = {http_port} }}\n'
        + ("" if job is None else f"[trainer.job]\n{job}\n")
    )
    return grpc_port, http_port


def start_trainer(config_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """``python -m services.trainer`` in its own session (so a test can kill it alone)."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "services.trainer", "--config", str(config_path)],
            cwd=REPO,
            env=service_env(TOKEN),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
