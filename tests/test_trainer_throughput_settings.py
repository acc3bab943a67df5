"""The trainer's throughput settings: activation checkpointing and torch.compile of the
decoder layers come from the job's model settings through ``Learner.load``; with
checkpointing the recorded RL and SFT steps are reproduced bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

from services.config.trainer import JobConfig
from services.trainer.learner import Learner
from tests.test_trainer_recorded_step import assert_reproduces, learner_rl, learner_sft
from tests.trainer_support import one_thread  # noqa: F401  (autouse: one torch thread)


def test_activation_checkpointing_reproduces_the_recorded_steps(tiny_model: Path) -> None:
    settings = {"activation_checkpointing": True}
    job = JobConfig.model_validate(
        {"phase": "rl", "model": {"compute_dtype": "float32", **settings}}
    )
    learner = Learner.load(tiny_model, job)
    assert learner.model.activation_checkpointing
    assert learner.reference is not None and not learner.reference.activation_checkpointing
    steps = {
        "learner_rl": learner_rl(tiny_model, settings),
        "learner_sft": learner_sft(tiny_model, settings),
    }
    assert_reproduces(json.loads(json.dumps(steps)))  # tuples as lists, as recorded


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
