"""Checkpoints in the object store under torchrun (two gloo processes, cp 2, experts over
both): every rank stores its shards, rank 0 the manifest; a job started on a fresh state
directory (another node) resumes from the store, ignores a save without its manifest,
and trains the next step into the same weights as the run that never stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import stop_process, write_config
from tests.test_dist_launch import steps_in, torchrun, wait_for

RUN = "test"
PREFIX = f"checkpoints/{RUN}"


def _configure(config: Path, tiny_model: Path, node: Path, max_steps: int) -> None:
    write_config(
        config,
        model_dir=tiny_model,
        state_dir=node,
        extra={
            "trainer.job": [
                'phase = "cpt"',
                f"max_steps = {max_steps}",
                f'export_dir = "{node / "export"}"',
                f'metrics_file = "{node / "metrics.jsonl"}"',
                "num_threads = 1",
                "publish_interval_steps = 0",
            ],
            "trainer.job.model": ['compute_dtype = "float32"', 'experts_precision = "fp32"'],
            "trainer.job.optimizer": ["lr = 1e-3"],
            "trainer.job.data": ["tokens_per_step = 512", "max_seq_len = 64"],
            "trainer.job.dist": ["cp = 2", "ep = 2", 'backend = "gloo"', "timeout_s = 120"],
            "trainer.job.rl": ["pull_wait_s = 5"],
            "trainer.job.checkpoint": ['location = "object_store"'],
        },
    )


def _train(config: Path, node: Path) -> None:
    node.mkdir(exist_ok=True)
    log = node / "trainer.log"
    process = torchrun(config, log)
    try:
        wait_for(node / "export" / "model.safetensors", process, log, timeout_s=180)
    finally:
        stop_process(process)  # rank 0 serves until SIGTERM


@pytest.mark.integration
@pytest.mark.slow
def test_torchrun_resumes_from_the_store_on_a_fresh_node(tiny_model: Path, tmp_path: Path) -> None:
    config, first, second = tmp_path / "config.toml", tmp_path / "node-a", tmp_path / "node-b"
    store = first / "store"
    _configure(config, tiny_model, first, max_steps=3)
    _train(config, first)
    reference = steps_in(first / "metrics.jsonl")
    assert [step["step"] for step in reference] == [1, 2, 3]
    assert not list((first / "checkpoints").rglob("*.distcp"))  # staging only, emptied
    manifest = json.loads((store / PREFIX / "step-00000003" / "manifest.json").read_text())
    assert manifest["num_shards"] == 2 and {o["shard"] for o in manifest["objects"]} == {0, 1}
    attempt = store / PREFIX / "step-00000003" / manifest["attempt"]
    assert sorted(p.name for p in attempt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # The run "crashed" before step 3's manifest: its shards are there, the manifest not.
    (store / PREFIX / "step-00000003" / "manifest.json").unlink()
    second.mkdir()
    (second / "store").symlink_to(store)  # the same bucket, seen from another node
    _configure(config, tiny_model, second, max_steps=3)
    _train(config, second)
    resumed = steps_in(second / "metrics.jsonl")
    assert [step["step"] for step in resumed] == [3]
    assert resumed[0]["loss"] == reference[2]["loss"]
    assert resumed[0]["cursor"] == reference[2]["cursor"]
    assert not [p for p in attempt.rglob("*") if p.is_file()]  # the unfinished save is gone
    weights = load_file(second / "export" / "model.safetensors")
    expected = load_file(first / "export" / "model.safetensors")
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
