"""Checkpoints in the object store: a run restored from the store into a fresh state
directory continues bit for bit; a save without its manifest is invisible and cleaned
up; periodic checkpoints are pruned; damaged objects are refused; the location setting."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.checkpoint import CheckpointException

from services.config import ObjectStoreConfig
from services.config.deployment import EtudeConfig
from services.config.trainer import CheckpointConfig, JobConfig
from services.objectstore.base import ObjectStore
from services.objectstore.local import FileObjectStore
from services.objectstore.s3 import S3ObjectStore
from services.trainer.checkpoint_objects import CheckpointError, ObjectStoreCheckpoints
from services.trainer.job import TrainingJob
from services.trainer.learner import Learner
from services.trainer.paths import checkpoint_dirs, checkpoint_root, checkpoints_in_store
from services.trainer.runtime import LocalRuntime
from services.trainer.sft import Example, to_microbatch
from tests.objectstore_support import make_bucket

STEPS, STOPPED_AT = 4, 2
TIMINGS = ("time_", "tokens_per_s")


def _config(
    state: Path, store_config: dict[str, Any], model: Path, *, max_steps: int, location: str
) -> EtudeConfig:
    return EtudeConfig.model_validate(
        {
            "run": {"name": "restore", "state_dir": str(state)},
            "object_store": store_config,
            "trainer": {
                "job": {
                    "phase": "cpt",
                    "num_threads": 1,
                    "seed": 0,
                    "model": {"model_dir": str(model), "compute_dtype": "float32"},
                    "data": {"kind": "corpus", "tokens_per_step": 192, "max_seq_len": 48},
                    "optimizer": {"lr": 1e-2, "warmup_steps": 1},
                    "max_steps": max_steps,
                    "publish_interval_steps": 0,
                    "metrics_file": str(state / "metrics.jsonl"),
                    "checkpoint": {"location": location, "keep_last": 2},
                }
            },
        }
    )


async def _train(config: EtudeConfig, store: ObjectStore) -> tuple[TrainingJob, list[dict]]:
    job = await asyncio.to_thread(TrainingJob.build, config, store, None, LocalRuntime())
    await job.run()
    assert job.state == "done", job.error
    lines = (config.run.state_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return job, [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in records]


@pytest.mark.parametrize("backend", ["file", "s3"])
async def test_a_run_restored_from_the_store_on_a_fresh_node_continues_exactly(
    tiny_model: Path, tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    store: ObjectStore
    if backend == "s3":
        endpoint = request.getfixturevalue("moto_endpoint")
        store_config = {
            "url": f"s3://{make_bucket(endpoint)}/runs",
            "endpoint_url": endpoint,
            "region": "us-east-1",
        }
        store = S3ObjectStore(
            store_config["url"].removeprefix("s3://").split("/")[0],
            "runs",
            ObjectStoreConfig.model_validate(store_config),
        )
        location = "auto"  # s3:// puts checkpoints in the store
    else:
        store_config = {"url": f"file://{tmp_path / 'store'}"}
        store, location = FileObjectStore(tmp_path / "store"), "object_store"

    def config(node: str, max_steps: int, where: str = location) -> EtudeConfig:
        return _config(
            tmp_path / node, store_config, tiny_model, max_steps=max_steps, location=where
        )

    reference_store = FileObjectStore(tmp_path / "reference-store")
    reference, expected = await _train(config("reference", STEPS, "local"), reference_store)
    assert not reference_store.list("checkpoints/")  # local: on the reference node's disk

    _, first = await _train(config("node-a", STOPPED_AT), store)
    assert first == expected[:STOPPED_AT]
    assert not checkpoint_dirs(checkpoint_root(config("node-a", STOPPED_AT)))
    # Node a is gone with its disk; node b starts on a fresh state directory.
    resumed, rest = await _train(config("node-b", STEPS), store)
    assert rest == expected[STOPPED_AT:]  # loss, grad norm, ... bit for bit
    assert resumed.cursor == reference.cursor
    for (name, a), b in zip(
        reference.learner.model.state_dict().items(),
        resumed.learner.model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
    assert [c.step for c in resumed.checkpoints.list()] == [3, 4]  # keep_last = 2
    assert [k for k in store.list("checkpoints/restore/") if "step-00000002" in k] == []
    assert not list((tmp_path / "node-b").rglob("*.distcp"))  # staging is emptied


def _learner(model: Path) -> Learner:
    job = JobConfig.model_validate(
        {"phase": "cpt", "data": {"kind": "corpus"}, "model": {"compute_dtype": "float32"}}
    )
    return Learner.load(model, job)


def _train_once(learner: Learner, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(16, 900, (12,), generator=generator).tolist() for _ in range(2)]
    learner.sft_step([to_microbatch([Example(t, [True] * len(t)) for t in tokens])], seed)


def test_manifest_last_pruning_tags_and_damage(tiny_model: Path, tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "store")
    prefix = "checkpoints/run"
    checkpoints = ObjectStoreCheckpoints(store, prefix, tmp_path / "staging", keep_last=2)
    learner = _learner(tiny_model)
    checkpoints.save(learner, {"step": 1}, step=1, tag="keep-me")
    for step in (1, 2, 3):
        _train_once(learner, step)
        checkpoints.save(learner, {"step": step}, step=step)
    with pytest.raises(FileExistsError, match="keep-me"):
        checkpoints.save(learner, {"step": 3}, step=3, tag="keep-me")
    assert [(c.tag, c.step) for c in checkpoints.list()] == [
        ("keep-me", 1),
        ("step-00000002", 2),
        ("step-00000003", 3),
    ]
    assert not store.list(f"{prefix}/step-00000001/")  # pruned, manifest and objects

    # A save that died before its manifest: every shard stored, no manifest.
    manifest = checkpoints.read_manifest("step-00000003")
    for entry in manifest.objects:
        unfinished = entry.key.replace("step-00000003", "step-00000004")
        store.put(unfinished, store.get(entry.key))
    latest = checkpoints.latest()
    assert latest is not None and latest.step == 3
    fresh = _learner(tiny_model)
    assert checkpoints.load(latest, fresh) == {"step": 3}
    for (name, a), b in zip(
        learner.model.state_dict().items(), fresh.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name

    # Saved again (a resumed job re-saves its step): the new manifest replaces the old,
    # and the earlier save's objects go.
    checkpoints.save(learner, {"step": 3, "again": True}, step=3)
    attempts = {k.split("/")[3] for k in store.list(f"{prefix}/step-00000003/") if k.count("/") > 3}
    assert attempts == {checkpoints.read_manifest("step-00000003").attempt}
    assert manifest.attempt not in attempts

    checkpoints.discard_partial()
    assert not store.list(f"{prefix}/step-00000004/")
    assert [c.step for c in checkpoints.list()] == [1, 2, 3]
    assert not list((tmp_path / "staging").iterdir())

    # A damaged object is refused, not loaded.
    entry = checkpoints.read_manifest("step-00000002").objects[0]
    store.put(entry.key, b"\0" * entry.size)
    info = next(c for c in checkpoints.list() if c.step == 2)
    with pytest.raises((CheckpointError, CheckpointException), match="SHA-256"):  # DCP wraps it
        checkpoints.load(info, _learner(tiny_model))


def test_the_location_setting(tmp_path: Path) -> None:
    def config(url: str, location: str) -> EtudeConfig:
        job = {"phase": "rl", "checkpoint": {"location": location}}
        return EtudeConfig.model_validate({"object_store": {"url": url}, "trainer": {"job": job}})

    assert not checkpoints_in_store(config(f"file://{tmp_path}", "auto"))  # embedded default
    assert checkpoints_in_store(config("s3://bucket/runs", "auto"))
    assert checkpoints_in_store(config(f"file://{tmp_path}", "object_store"))
    assert not checkpoints_in_store(config("s3://bucket/runs", "local"))
    with pytest.raises(ValidationError, match=r"checkpoint.prefix '../up'"):
        CheckpointConfig(prefix="../up")


@pytest.mark.redis
def test_the_launcher_resumes_from_and_forgets_checkpoints_in_the_store(tmp_path: Path) -> None:
    import secrets

    import redis
    from rich.console import Console

    from services.config.deployment import load_config
    from services.launcher.run import LocalRun, RunFailed, RunOptions
    from services.reconciler.store import run_prefix
    from tests.conftest import write_config

    name = f"stored-{secrets.token_hex(4)}"
    config = tmp_path / "config.toml"
    job = ['phase = "rl"', "[trainer.job.checkpoint]", 'location = "object_store"']
    write_config(
        config,
        model_dir=tmp_path / "model",
        state_dir=tmp_path / "state",
        run_name=name,
        extra={"trainer.job": job},
    )
    run = LocalRun(load_config(config, environ={}), config, Console(), RunOptions())
    client = redis.Redis.from_url(run.config.redis.url)
    key = f"{run_prefix(name)}:consumer:trainer"
    client.hset(key, "committed_step", 29)
    try:
        unfinished = f"checkpoints/{name}/step-00000030/a1/__0_0.distcp"
        run.store.put(unfinished, b"shards without a manifest")
        with pytest.raises(RunFailed, match=rf"no trainer checkpoint in file://.*/{name}"):
            run._check_resumable()
        run.store.put(f"checkpoints/{name}/step-00000030/manifest.json", b"{}")
        run._check_resumable()  # the checkpoint it resumes from is in the store
        run._forget_run()  # --fresh
        assert not run.store.list(f"checkpoints/{name}/")
    finally:
        client.delete(key)
        client.close()
