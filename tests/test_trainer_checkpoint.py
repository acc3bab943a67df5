"""Checkpoints in-process: exact round trips (AdamW and Muon), tags, retention, torn saves."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.config.trainer import JobConfig
from services.trainer.checkpoint import CheckpointStore
from services.trainer.learner import Learner
from services.trainer.optim import muon_parameter
from services.trainer.sft import Example, to_microbatch


def _job(optimizer: str) -> JobConfig:
    return JobConfig.model_validate(
        {
            "phase": "cpt",
            "data": {"kind": "corpus"},
            "model": {"compute_dtype": "float32"},
            "optimizer": {"name": optimizer, "lr": 1e-2, "warmup_steps": 2},
        }
    )


def _batch(seed: int) -> list[Example]:
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(16, 900, (20,), generator=generator).tolist() for _ in range(3)]
    return [Example(t, [True] * len(t)) for t in tokens]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_loaded_checkpoint_continues_exactly(
    tiny_model: Path, tmp_path: Path, optimizer: str
) -> None:
    job = _job(optimizer)
    first = Learner.load(tiny_model, job)
    if optimizer == "muon":
        assert len(first.optimizers) == 2
        names = [n for n, p in first.model.named_parameters() if muon_parameter(n, p)]
        assert names and all("self_attn" in n or "mlp.experts" in n for n in names)
        assert any("mlp.experts" in n for n in names)  # expert stacks too
    for step in range(2):
        first.sft_step([to_microbatch(_batch(step))], step)
    store = CheckpointStore(tmp_path / "ckpt")
    torch.manual_seed(123)
    random.seed(5)
    store.save(first, {"step": 2, "cursor": 17}, step=2)
    expected_draws = (torch.rand(3), random.random())
    second = Learner.load(tiny_model, job)
    torch.manual_seed(999)
    latest = store.latest()
    assert latest is not None and latest.step == 2
    assert store.load(latest, second) == {"step": 2, "cursor": 17}
    assert torch.equal(torch.rand(3), expected_draws[0]) and random.random() == expected_draws[1]
    metrics = [learner.sft_step([to_microbatch(_batch(2))], 2) for learner in (first, second)]
    assert metrics[0]["loss"] == metrics[1]["loss"]
    for (name, a), b in zip(
        first.model.state_dict().items(), second.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_tags_stay_periodic_checkpoints_rotate_and_torn_saves_are_ignored(
    tiny_model: Path, tmp_path: Path
) -> None:
    learner = Learner.load(tiny_model, _job("adamw"))
    store = CheckpointStore(tmp_path / "ckpt", keep_last=2)
    store.save(learner, {"step": 1}, step=1, tag="keep-me")
    for step in (1, 2, 3):
        store.save(learner, {"step": step}, step=step)
    with pytest.raises(FileExistsError, match="keep-me"):
        store.save(learner, {"step": 3}, step=3, tag="keep-me")
    (tmp_path / "ckpt" / ".step-00000004.partial-1").mkdir()  # a save killed halfway
    assert [(c.tag, c.step) for c in store.list()] == [
        ("keep-me", 1),
        ("step-00000002", 2),
        ("step-00000003", 3),
    ]
    store.discard_partial()
    assert not (tmp_path / "ckpt" / ".step-00000004.partial-1").exists()
