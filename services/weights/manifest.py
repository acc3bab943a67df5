"""The layout of published versions in the object store and their manifests.

    weights/<run>/v00000042/manifest.json        written last: the version exists
    weights/<run>/v00000042/shard-0003-g0001.bin one object per (trainer shard, tensor group)
    weights/<run>/v00000042/shards/0003.json     a shard's part, written when its objects are in
    weights/<run>/latest                         {"version": 42}, moved after the manifest

A reader trusts only manifests, and a manifest lists every object with its size and
SHA-256, so a half-published version is invisible and a damaged one is detected.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.objectstore.base import ObjectNotFound, ObjectStore

FORMAT_VERSION = 1


class WeightsError(RuntimeError):
    """A version cannot be published or loaded; the message names the version and object."""


class TensorEntry(BaseModel):
    """Where one tensor's encoded bytes are, and how to decode them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    dtype: str
    shape: tuple[int, ...]
    object: str = Field(description="Key of the object holding the tensor.")
    offset: int = Field(ge=0)
    length: int = Field(ge=0)
    encoding: Literal["raw", "xor_sparse", "xor_dense"]
    base_version: int | None = Field(description="Version the delta applies to; None: raw.")
    crc32: int = Field(ge=0, description="CRC-32 of the decoded raw bits.")


class ObjectEntry(BaseModel):
    """One stored object of a version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    shard: int = Field(ge=0)


class ShardPart(BaseModel):
    """What one trainer shard published for a version."""

    model_config = ConfigDict(extra="forbid")

    shard: int = Field(ge=0)
    objects: list[ObjectEntry]
    tensors: list[TensorEntry]
    raw_bytes: int = Field(ge=0, description="Size of the shard's tensors, uncompressed.")


class Manifest(BaseModel):
    """A complete published version."""

    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT_VERSION
    run: str
    version: int = Field(ge=0)
    keyframe: bool = Field(description="Every tensor is raw: no earlier version is needed.")
    num_shards: int = Field(ge=1)
    created_at: float
    raw_bytes: int = Field(ge=0)
    stored_bytes: int = Field(ge=0)
    objects: list[ObjectEntry]
    tensors: list[TensorEntry]
    model: dict[str, str] | None = Field(
        None,
        description="Fingerprint of the model it was trained from (services.model_source): "
        "a replica of another model refuses it. None in versions from before it was kept.",
    )

    @property
    def base_versions(self) -> set[int]:
        """Versions this one's deltas apply to."""
        return {t.base_version for t in self.tensors if t.base_version is not None}


class Layout:
    """Keys of a run's versions."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.root = f"weights/{run}"

    def version_dir(self, version: int) -> str:
        """Prefix of every key of `version`."""
        return f"{self.root}/v{version:08d}"

    def manifest(self, version: int) -> str:
        """Key of the manifest of `version`."""
        return f"{self.version_dir(version)}/manifest.json"

    def object(self, version: int, shard: int, group: int) -> str:
        """Key of one (shard, tensor group) object."""
        return f"{self.version_dir(version)}/shard-{shard:04d}-g{group:04d}.bin"

    def shard_part(self, version: int, shard: int) -> str:
        """Key of a shard's part of the manifest."""
        return f"{self.version_dir(version)}/shards/{shard:04d}.json"

    @property
    def latest(self) -> str:
        """Key of the pointer to the newest complete version."""
        return f"{self.root}/latest"

    def parse_version(self, key: str) -> int | None:
        """The version a manifest key belongs to, or None for other keys."""
        prefix = f"{self.root}/v"
        if key.startswith(prefix) and key.endswith("/manifest.json"):
            digits = key[len(prefix) : -len("/manifest.json")]
            if digits.isdigit():
                return int(digits)
        return None


def read_manifest(store: ObjectStore, layout: Layout, version: int) -> Manifest:
    """The manifest of `version`; WeightsError when it is absent or malformed."""
    key = layout.manifest(version)
    try:
        manifest = Manifest.model_validate_json(store.get(key))
    except ObjectNotFound as error:
        raise WeightsError(f"version {version} of {layout.run} has no manifest ({key})") from error
    except ValidationError as error:
        raise WeightsError(f"{key} is not a valid manifest: {error}") from error
    if manifest.format != FORMAT_VERSION or manifest.version != version:
        raise WeightsError(
            f"{key}: format {manifest.format} version {manifest.version} "
            f"(expected format {FORMAT_VERSION} version {version})"
        )
    return manifest


def read_latest(store: ObjectStore, layout: Layout) -> int | None:
    """The newest complete version, or None before the first."""
    try:
        return int(json.loads(store.get(layout.latest))["version"])
    except ObjectNotFound:
        return None
    except (ValueError, KeyError, TypeError) as error:
        raise WeightsError(f"{layout.latest} is malformed: {error}") from error


def list_versions(store: ObjectStore, layout: Layout) -> list[int]:
    """Every version with a manifest, ascending."""
    keys = store.list(f"{layout.root}/v")
    return sorted(v for v in map(layout.parse_version, keys) if v is not None)
