"""A layout that does not fit is a clear error at start-up, before any collective.

Each bad setting is refused by ``ParallelLayout.resolve`` / ``layout.check_job`` with a
message naming it and what is allowed, and ``etude serve trainer`` under torchrun
raises it on every rank before joining the process group (so no rank waits in a
collective for one that already exited).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from services.config.deployment import EtudeConfig
from services.config.trainer import JobConfig
from services.trainer.distributed.layout import ParallelLayout, check_job
from services.trainer.model import Architecture
from services.trainer.service import run as run_trainer

ARCH = Architecture(
    vocab_size=96,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=6,
    top_k=2,
    moe_intermediate_size=32,
    max_position_embeddings=256,
)


@pytest.mark.parametrize(
    ("world_size", "degrees", "message"),
    [
        (
            6,
            {"cp": 4},
            r"dist\.cp \(4\) must divide the world size \(6 processes\); "
            r"allowed: \[1, 2, 3, 6\]",
        ),
        (
            8,
            {"dp": 3, "cp": 2},
            r"dist\.dp x dist\.cp \(3 x 2 = 6\) must equal the world size "
            r"\(8 processes\)",
        ),
        (8, {"ep": 3}, r"dist\.ep \(3\) must divide the world size \(8 = dp 8 x cp 1\)"),
        (
            8,
            {"ep": 4},
            r"num_experts \(6\) must be divisible by dist\.ep \(4\); "
            r"allowed: \[1, 2\]",
        ),
        (1, {"cp": 2}, r"dist\.cp \(2\) must divide the world size \(1 processes\)"),
        (4, {"cp": 0}, r"dist degrees must be positive"),
    ],
    ids=[
        "cp-not-dividing-world",
        "dp-x-cp-not-world",
        "ep-not-dividing-world",
        "experts-not-divisible-by-ep",
        "cp-in-one-process",
        "cp-zero",
    ],
)
def test_a_layout_that_does_not_fit_names_the_setting(
    world_size: int, degrees: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelLayout.resolve(world_size, num_experts=ARCH.num_experts, **degrees)


def test_layouts_that_fit() -> None:
    layout = ParallelLayout.resolve(8, cp=2, ep=2, num_experts=ARCH.num_experts)
    assert (layout.dp, layout.cp, layout.ep, layout.edp) == (4, 2, 2, 4)
    # ep spans dp x cp: 6 ranks of 3 dp replicas x cp 2 hold the 6 experts once.
    layout = ParallelLayout.resolve(6, cp=2, ep=6, num_experts=ARCH.num_experts)
    assert [list(layout.local_experts(rank, 6)) for rank in range(6)] == [[r] for r in range(6)]
    assert [layout.dp_index(rank) for rank in range(6)] == [0, 0, 1, 1, 2, 2]


def job(**settings: object) -> JobConfig:
    return JobConfig.model_validate({"phase": "rl", **settings})


def test_check_job_refuses_what_a_sharded_layout_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"model\.num_mtp_heads \(1\) .* dist\.cp \(2\)"):
        check_job(job(model={"num_mtp_heads": 1}, dist={"cp": 2}), ARCH, 4)
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by dist\.ep"):
        check_job(job(dist={"ep": 4}), ARCH, 4)
    # Muon shards: each matrix is orthogonalized whole (services.trainer.muon).
    assert not check_job(job(optimizer={"name": "muon"}), ARCH, 2).is_single_process


def write_model_config(model_dir: Path) -> Path:
    """Just the ``config.json`` of a model: all the start-up checks read."""
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_moe",
                "vocab_size": ARCH.vocab_size,
                "hidden_size": ARCH.hidden_size,
                "num_hidden_layers": ARCH.num_layers,
                "num_attention_heads": ARCH.num_attention_heads,
                "num_key_value_heads": ARCH.num_key_value_heads,
                "head_dim": ARCH.head_dim,
                "num_experts": ARCH.num_experts,
                "num_experts_per_tok": ARCH.top_k,
                "moe_intermediate_size": ARCH.moe_intermediate_size,
                "max_position_embeddings": ARCH.max_position_embeddings,
            }
        )
    )
    return model_dir


@pytest.mark.parametrize(
    ("world_size", "dist_settings", "message"),
    [
        (6, {"cp": 4}, r"dist\.cp \(4\) must divide the world size \(6 processes\)"),
        (4, {"ep": 4}, r"num_experts \(6\) must be divisible by dist\.ep \(4\)"),
    ],
)
def test_serve_trainer_under_torchrun_fails_before_joining_the_group(
    world_size: int,
    dist_settings: dict[str, int],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What torchrun sets, without a rendezvous address: had the check come after joining
    the process group, this would fail differently (or wait)."""
    model_dir = write_model_config(tmp_path / "model")
    config = EtudeConfig.model_validate(
        {
            "run": {"state_dir": str(tmp_path / "state")},
            "trainer": {
                "job": {
                    "phase": "rl",
                    "model": {"model_dir": str(model_dir)},
                    "dist": dist_settings,
                }
            },
        }
    )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=message):
        run_trainer(config)
    assert not dist.is_initialized()
