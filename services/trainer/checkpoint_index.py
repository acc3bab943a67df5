"""Which checkpoints a run has, read without torch: the local checkpoints' metadata files
and the object store's manifests. The trainer's checkpoint stores list through here, and
so do an idle trainer's ``ListCheckpoints`` and the launcher, which import no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.objectstore.base import ObjectNotFound, ObjectStore
from services.trainer.paths import (
    MANIFEST,
    META_FILE,
    checkpoint_dirs,
    checkpoint_prefix,
    checkpoint_root,
    checkpoints_in_store,
    manifest_names,
)
from services.weights.manifest import ObjectEntry

if TYPE_CHECKING:
    from services.config.trainer import TrainerProcessConfig

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint in the object store cannot be read; the message names the object."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: on disk (``location`` its directory) or in the object store
    (``location`` its key prefix)."""

    tag: str
    step: int
    location: Path | str
    created_at: float
    name: str = ""
    """``step-<n>`` (periodic, pruned) or ``tag-<tag>`` (kept)."""


class ShardObjects(BaseModel):
    """The objects one rank stored for a checkpoint."""

    model_config = ConfigDict(extra="forbid")

    shard: int = Field(ge=0)
    objects: list[ObjectEntry]


class CheckpointManifest(BaseModel):
    """A complete checkpoint: its objects and what the job needs to continue."""

    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT_VERSION
    name: str
    tag: str
    step: int = Field(ge=0)
    created_at: float
    attempt: str = Field(description="The save's key prefix under the checkpoint's name.")
    num_shards: int = Field(ge=1)
    objects: list[ObjectEntry]
    job: dict[str, Any]
    python_rng: list[Any]


def manifest_key(prefix: str, name: str) -> str:
    """The key of checkpoint ``name``'s manifest under ``prefix``."""
    return f"{prefix}/{name}/{MANIFEST}"


def read_checkpoint_manifest(store: ObjectStore, prefix: str, name: str) -> CheckpointManifest:
    """The manifest of checkpoint ``name``; CheckpointError when absent or malformed."""
    key = manifest_key(prefix, name)
    try:
        manifest = CheckpointManifest.model_validate_json(store.get(key))
    except ObjectNotFound as error:
        raise CheckpointError(f"{store.url}/{key} does not exist") from error
    except ValidationError as error:
        raise CheckpointError(f"{key} is not a checkpoint manifest: {error}") from error
    if manifest.format != FORMAT_VERSION:
        raise CheckpointError(f"{key}: format {manifest.format}, expected {FORMAT_VERSION}")
    return manifest


def _oldest_first(found: list[CheckpointInfo]) -> list[CheckpointInfo]:
    return sorted(found, key=lambda info: (info.step, info.created_at))


def list_local_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Every complete checkpoint in the directory ``root``, oldest step first."""
    found = []
    for path in checkpoint_dirs(root):
        meta = json.loads((path / META_FILE).read_text())
        found.append(
            CheckpointInfo(meta["tag"], int(meta["step"]), path, meta["created_at"], path.name)
        )
    return _oldest_first(found)


def list_store_checkpoints(store: ObjectStore, prefix: str) -> list[CheckpointInfo]:
    """Every checkpoint with a manifest under ``prefix``, oldest step first."""
    found = []
    for name in manifest_names(store.list(f"{prefix}/"), prefix):
        manifest = read_checkpoint_manifest(store, prefix, name)
        location = f"{prefix}/{name}"
        found.append(
            CheckpointInfo(manifest.tag, manifest.step, location, manifest.created_at, name)
        )
    return _oldest_first(found)


def list_checkpoints(config: TrainerProcessConfig, store: ObjectStore) -> list[CheckpointInfo]:
    """The run's checkpoints, wherever ``checkpoint.location`` puts them."""
    if checkpoints_in_store(config):
        return list_store_checkpoints(store, checkpoint_prefix(config))
    return list_local_checkpoints(checkpoint_root(config))
