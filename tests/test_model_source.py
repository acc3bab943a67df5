"""The base model's one source: pushed to the object store, synced into each pod's
model.dir (verified, atomically, once however many processes start at once), named by
a fingerprint of architecture and tokenizer, and one directory for every service."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.config import ObjectStoreConfig
from services.config.deployment import EtudeConfig
from services.model_source import (
    FILE_LIST,
    ModelSourceError,
    fingerprint,
    push_model,
    sync_model,
)
from services.objectstore import ObjectStore, open_store
from services.process import bring_model

PREFIX = "models/tiny"


def _store(root: Path) -> ObjectStore:
    return open_store(ObjectStoreConfig(url=f"file://{root}/store"))


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir() if not p.name.startswith(".etude")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def test_a_pushed_model_syncs_once_verified_and_never_over_another(
    tiny_model: Path, tmp_path: Path
) -> None:
    store = _store(tmp_path)
    size = push_model(store, tiny_model, PREFIX)
    assert size == sum(p.stat().st_size for p in tiny_model.iterdir())
    target = tmp_path / "pod" / "models" / "tiny"
    assert sync_model(store, PREFIX, target) is True
    assert _same_files(tiny_model, target)
    assert fingerprint(target) == fingerprint(tiny_model)
    assert sync_model(store, PREFIX, target) is False  # a restart finds it in place

    # Another model in the directory, or files it was not synced with: refused, kept.
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    with pytest.raises(ModelSourceError, match="not synced from"):
        sync_model(store, PREFIX, other)
    assert _same_files(tiny_model, other)
    # An object that does not match the file list is refused, and nothing is left behind.
    store.put(f"{PREFIX}/tokenizer.json", b"{}")
    fresh = tmp_path / "fresh" / "tiny"
    with pytest.raises(ModelSourceError, match=r"tokenizer\.json: size or SHA-256"):
        sync_model(store, PREFIX, fresh)
    assert not fresh.exists() and list(fresh.parent.iterdir()) == []
    # No upload under the prefix: the message says how to make one.
    with pytest.raises(ModelSourceError, match="etude model push"):
        sync_model(store, "models/none", tmp_path / "none")


def _sync_in_process(root: str, target: str) -> bool:
    return sync_model(_store(Path(root)), PREFIX, Path(target))


def test_ranks_that_sync_at_once_end_with_one_whole_copy(tiny_model: Path, tmp_path: Path) -> None:
    push_model(_store(tmp_path), tiny_model, PREFIX)
    target = tmp_path / "models" / "tiny"
    target.mkdir(parents=True)  # an empty directory (a fresh volume) counts as no model
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        downloaded = pool.starmap(_sync_in_process, [(str(tmp_path), str(target))] * 4)
    assert 1 <= sum(downloaded) <= 4 and _same_files(tiny_model, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]  # no staging left


def test_the_fingerprint_is_architecture_and_tokenizer(tiny_model: Path, tmp_path: Path) -> None:
    base = fingerprint(tiny_model)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    assert fingerprint(copy) == base  # the dtype is not the architecture
    (copy / "config.json").write_text(json.dumps({**config, "num_experts": 99}))
    assert fingerprint(copy).architecture != base.architecture
    assert fingerprint(copy).tokenizer == base.tokenizer
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "tokenizer_config.json").write_text("{}")
    changed = fingerprint(copy)
    assert changed.architecture == base.architecture and changed.tokenizer != base.tokenizer
    assert str(base).startswith(f"{tiny_model}: architecture {base.architecture[:12]}, tokenizer ")


def test_one_model_directory_for_every_service(tiny_model: Path, tmp_path: Path) -> None:
    config = EtudeConfig.model_validate({"model": {"dir": str(tiny_model)}})
    assert config.inference.engine.model_dir == tiny_model  # what trainer and envs read too
    same = {
        "model": {"dir": str(tiny_model)},
        "inference": {"engine": {"model_dir": str(tiny_model)}},
    }
    assert EtudeConfig.model_validate(same).inference.engine.model_dir == tiny_model
    with pytest.raises(ValidationError, match=r"model\.dir .* and inference\.engine\.model_dir"):
        EtudeConfig.model_validate(
            {"model": {"dir": str(tiny_model)}, "inference": {"engine": {"model_dir": "/x"}}}
        )
    with pytest.raises(ValidationError, match=r"model\.store_prefix needs model\.dir"):
        EtudeConfig.model_validate({"model": {"store_prefix": PREFIX}})
    for prefix in ("../models", "models//tiny", "/models", "models/tiny\n"):
        with pytest.raises(ValidationError, match="store_prefix"):
            EtudeConfig.model_validate({"model": {"dir": "/m", "store_prefix": prefix}})

    # What a service process does before it imports its module.
    push_model(_store(tmp_path), tiny_model, PREFIX)
    pod_dir = tmp_path / "pod" / "tiny"
    synced = EtudeConfig.model_validate(
        {
            "object_store": {"url": f"file://{tmp_path}/store"},
            "model": {"dir": str(pod_dir), "store_prefix": PREFIX},
        }
    )
    bring_model(synced)
    assert fingerprint(pod_dir) == fingerprint(tiny_model)
    assert (tmp_path / "store" / PREFIX / FILE_LIST).is_file()


def _another(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny model with one more expert: another architecture, the same tokenizer."""
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_experts": 99}))
    return other


async def test_trainer_and_inference_refuse_each_others_other_model(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Every version names the model it was trained from; a replica of another model
    refuses it, and so does a trainer started on another model for the run's versions,
    each message naming both models."""
    from services.config import WeightsConfig
    from services.model_source import ModelMismatch
    from services.objectstore.local import FileObjectStore
    from services.weights.publisher import WeightPublisher
    from services.weights.subscriber import WeightSubscriber
    from tests.test_supervised_publishers import DictRuntime, weights

    store = FileObjectStore(tmp_path / "store")
    config = WeightsConfig(collect_garbage=False)
    ours, theirs = fingerprint(tiny_model), fingerprint(_another(tiny_model, tmp_path))
    publisher = WeightPublisher(store, "run", config, model=ours)
    try:
        publisher.publish(weights(1), 1).result(timeout=30)
    finally:
        publisher.close()
    loaded = WeightSubscriber(store, "run", config, ours).load(1)
    assert float(loaded["layer.weight"][0, 0]) == 1.0
    with pytest.raises(ModelMismatch) as refused:
        WeightSubscriber(store, "run", config, theirs).load(1)
    message = str(refused.value)
    assert "policy version 1" in message and str(ours) in message and str(theirs) in message

    from services.trainer.publishing import PolicyPublisher

    with pytest.raises(ModelMismatch, match="the run's version 1"):
        PolicyPublisher(store, "run", config, None, DictRuntime(), theirs)
    same = PolicyPublisher(store, "run", config, None, DictRuntime(), ours)
    assert same.already_published == 1
    same.close()
