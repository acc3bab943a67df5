"""The trainer's throughput settings: activation checkpointing and torch.compile of the
decoder layers come from the job's model settings through ``Learner.load``; with
checkpointing the recorded RL and SFT steps are reproduced bit for bit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.trainer.batch import RLBatch, pack_microbatch
from services.trainer.config import JobConfig
from services.trainer.learner import Learner
from services.trainer.sft import Example, to_microbatch
from tests.test_trainer_recorded_step import FIXTURE, checksum, rl_items, untimed


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_activation_checkpointing_reproduces_the_recorded_steps(tiny_model: Path) -> None:
    recorded = json.loads(FIXTURE.read_text())
    model = {"compute_dtype": "float32", "activation_checkpointing": True}
    rl_job = JobConfig.model_validate(
        {
            "phase": "rl",
            "model": model,
            "optimizer": {"lr": 1e-3, "max_grad_norm": 0.5},
            "rl": {"kl_coef": 0.01, "generation_budget_tokens": 32},
        }
    )
    torch.manual_seed(0)
    learner = Learner.load(tiny_model, rl_job)
    assert learner.model.activation_checkpointing
    assert learner.reference is not None and not learner.reference.activation_checkpointing
    items = rl_items(1)
    microbatches = [pack_microbatch(items[:2], 2, 2), pack_microbatch(items[2:], 2, 2)]
    metrics = learner.rl_step(RLBatch(microbatches, 4, [], [], []), 0)
    assert untimed(metrics) == recorded["learner_rl"]["metrics"]
    assert checksum(learner.model) == recorded["learner_rl"]["weights"]

    sft_job = JobConfig.model_validate(
        {
            "phase": "cpt",
            "data": {"kind": "corpus"},
            "model": model,
            "optimizer": {"lr": 1e-3, "warmup_steps": 2},
        }
    )
    torch.manual_seed(0)
    learner = Learner.load(tiny_model, sft_job)
    generator = torch.Generator().manual_seed(2)
    examples = []
    for length in (20, 33, 12):
        tokens = torch.randint(16, 900, (length,), generator=generator).tolist()
        examples.append(Example(tokens, [position >= 4 for position in range(length)]))
    metrics = learner.sft_step([to_microbatch(examples)], 1)
    assert untimed(metrics) == recorded["learner_sft"]["metrics"]
    assert checksum(learner.model) == recorded["learner_sft"]["weights"]


def test_defaults_leave_both_off_and_compile_wraps_every_layer(tiny_model: Path) -> None:
    job = JobConfig.model_validate({"phase": "rl", "model": {"compute_dtype": "float32"}})
    assert not job.model.activation_checkpointing and not job.model.compile
    learner = Learner.load(tiny_model, job)
    assert not learner.model.activation_checkpointing
    assert all(layer._compiled_call_impl is None for layer in learner.model.model.layers)

    job = JobConfig.model_validate(
        {"phase": "rl", "model": {"compute_dtype": "float32", "compile": True}}
    )
    learner = Learner.load(tiny_model, job)
    assert learner.reference is not None
    for model in (learner.model, learner.reference):
        # Compiled lazily, at the first call: building the learner compiles nothing yet.
        assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
