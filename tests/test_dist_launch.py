"""`etude serve trainer` under torchrun: two gloo processes (cp 2, experts over both) run
a CPT job on the tiny model, write sharded checkpoints, publish two-shard versions and
export the model; started again with more steps, the job resumes where it stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, TOKEN, service_env, stop_process, write_config


def torchrun(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "-m",
                "services.cli",
                "serve",
                "trainer",
                "--config",
                str(config),
            ],
            cwd=REPO,
            env=service_env(TOKEN),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(done: Path, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{done} did not appear:\n{log.read_text()[-6000:]}")
        time.sleep(0.2)


def steps_in(metrics: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.slow
def test_torchrun_trains_checkpoints_publishes_and_resumes(
    tiny_model: Path, tmp_path: Path
) -> None:
    config, log, metrics = tmp_path / "config.toml", tmp_path / "trainer.log", tmp_path / "m.jsonl"
    export, state = tmp_path / "export", tmp_path / "state"

    def configure(max_steps: int) -> None:
        write_config(
            config,
            model_dir=tiny_model,
            state_dir=state,
            extra={
                "trainer.job": [
                    'phase = "cpt"',
                    f"max_steps = {max_steps}",
                    f'export_dir = "{export}"',
                    f'metrics_file = "{metrics}"',
                    "num_threads = 1",
                ],
                "trainer.job.model": ['compute_dtype = "float32"', 'experts_precision = "fp32"'],
                "trainer.job.optimizer": ["lr = 1e-3"],
                "trainer.job.data": ["tokens_per_step = 1024", "max_seq_len = 128"],
                "trainer.job.dist": ["cp = 2", "ep = 2", 'backend = "gloo"', "timeout_s = 120"],
                "trainer.job.rl": ["pull_wait_s = 5"],
            },
        )

    configure(max_steps=2)
    process = torchrun(config, log)
    try:
        wait_for(export / "model.safetensors", process, log, timeout_s=180)
    finally:
        stop_process(process)  # rank 0 serves until SIGTERM (torchrun then exits 1)
    first = steps_in(metrics)
    assert [step["step"] for step in first] == [1, 2]
    checkpoints = state / "checkpoints" / "test"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-00000001", "step-00000002"]
    assert len(list((checkpoints / "step-00000002").glob("*.distcp"))) == 2
    manifest = json.loads((state / "store/weights/test/v00000002/manifest.json").read_text())
    assert manifest["version"] == 2
    assert sorted(p.name for p in (state / "store/weights/test/v00000002/shards").iterdir()) == [
        "0000.json",
        "0001.json",
    ]
    exported, initial = (
        load_file(export / "model.safetensors"),
        load_file(tiny_model / "model.safetensors"),
    )
    assert exported.keys() == initial.keys()
    assert any(not torch.equal(exported[name], initial[name]) for name in initial)

    configure(max_steps=3)
    (export / "model.safetensors").unlink()
    process = torchrun(config, log)
    try:
        wait_for(export / "model.safetensors", process, log, timeout_s=180)
    finally:
        stop_process(process)
    resumed = steps_in(metrics)
    assert [step["step"] for step in resumed] == [1, 2, 3]
    assert resumed[2]["cursor"] > first[1]["cursor"], "the data picks up after the checkpoint"
