"""Checkpoints in the object store: restorable on any node, manifest written last.

A checkpoint is the same DCP files as on disk, one object each, and a manifest::

    <prefix>/<run>/step-00000042/<attempt>/__0_0.distcp   rank 0's shard of the state
    <prefix>/<run>/step-00000042/<attempt>/__1_0.distcp   rank 1's
    <prefix>/<run>/step-00000042/<attempt>/metadata       DCP's plan (``.metadata``)
    <prefix>/<run>/step-00000042/<attempt>/shards/0001.json  rank 1's objects, once stored
    <prefix>/<run>/step-00000042/manifest.json            written last: now it exists

Saving is collective: every rank writes its shards with ``dcp.save`` into a staging
directory of its own (local disk), uploads them and writes its part; after a barrier
rank 0 reads the parts and writes the manifest (every object with its size and SHA-256,
the step, the job's state, the Python RNG), then prunes. This is the weight exchange's
protocol (``services/weights``), and the manifest lists its objects with the same
``ObjectEntry``; the weights' ``Manifest`` itself describes encoded tensors of a
version, not a checkpoint's files, so the checkpoint has its own (``CheckpointManifest``).
A reader trusts only manifests: a save that died half-way is invisible, and its objects
are deleted at the next start (``discard_partial``). A checkpoint saved again (the same
step after a resume) goes to a new ``<attempt>``, and its new manifest replaces the old
one in one put.

Loading is collective too: each rank downloads DCP's metadata and then only the objects
its shards are read from (checked against the manifest) into a local directory, and
``dcp.load`` reads them there.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from services.objectstore.base import ObjectStore, sha256_hex
from services.trainer.checkpoint import (
    Checkpoints,
    checkpoint_name,
    dcp_call,
    job_meta,
    learner_state,
    restore,
)
from services.trainer.checkpoint_index import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManifest,
    ShardObjects,
    list_store_checkpoints,
    manifest_key,
    read_checkpoint_manifest,
)
from services.trainer.learner import Learner
from services.trainer.paths import manifest_names
from services.trainer.runtime import LocalRuntime, TrainerRuntime
from services.weights.manifest import ObjectEntry


def _object_name(file_name: str) -> str:
    """DCP's ``.metadata`` as ``metadata``: stores may hide dot-files (``file://`` does)."""
    return file_name.lstrip(".")


class _StoreReader(FileSystemReader):
    """DCP's file reader over ``directory``, fetching each file from the store on first use."""

    def __init__(self, store: ObjectStore, objects: list[ObjectEntry], directory: Path) -> None:
        super().__init__(directory)
        self.store, self.directory = store, directory
        self.objects = {entry.key.rsplit("/", 1)[1]: entry for entry in objects}

    def _fetch(self, file_name: str) -> None:
        path = self.directory / file_name
        if path.exists():
            return
        entry = self.objects.get(_object_name(file_name))
        if entry is None:
            raise CheckpointError(f"the checkpoint's manifest lists no object for {file_name}")
        data = self.store.get(entry.key)
        if len(data) != entry.size or sha256_hex(data) != entry.sha256:
            raise CheckpointError(
                f"{self.store.url}/{entry.key}: {len(data)} bytes with another SHA-256 than "
                f"the manifest's ({entry.size} bytes, {entry.sha256[:12]}...)"
            )
        partial = path.with_name(f".{path.name}.partial")
        partial.write_bytes(data)
        partial.rename(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        self._fetch(".metadata")
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for file_name in {
            self.storage_data[item.storage_index].relative_path for item in plan.items
        }:
            self._fetch(file_name)
        return super().read_data(plan, planner)


class ObjectStoreCheckpoints(Checkpoints):
    """The checkpoints of one run under the key ``prefix`` of ``store``; ``staging`` is a
    local directory for the files of a save or a resume (emptied afterwards)."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        staging: Path,
        keep_last: int = 3,
        runtime: TrainerRuntime | None = None,
    ) -> None:
        self.store, self.prefix, self.staging = store, prefix.strip("/"), Path(staging)
        self.keep_last = keep_last
        self.runtime = runtime or LocalRuntime()

    def _manifest_key(self, name: str) -> str:
        return manifest_key(self.prefix, name)

    def save(
        self, learner: Learner, job_state: dict[str, Any], *, step: int, tag: str | None = None
    ) -> CheckpointInfo:
        """Writes a checkpoint of ``learner`` after ``step`` completed steps (collective)."""
        runtime, name = self.runtime, checkpoint_name(step, tag)
        # Rank 0 decides, so that no rank writes while another refused.
        taken = runtime.share(bool(tag) and runtime.is_leader and self._exists(name))
        if taken:
            raise FileExistsError(f"checkpoint tag {tag!r} exists ({self._manifest_key(name)})")
        attempt = runtime.share(uuid.uuid4().hex[:16] if runtime.is_leader else None)
        directory = self.staging / f".save-{attempt}-rank{runtime.rank:05d}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        try:
            dcp_call(dcp.save, learner_state(learner), checkpoint_id=directory)
            self._upload(directory, f"{self.prefix}/{name}/{attempt}")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        created_at = runtime.share(time.time())
        label = tag or name
        runtime.barrier()  # every rank's part is in
        if runtime.is_leader:
            meta = job_meta(label, step, created_at, job_state)
            self._write_manifest(name, attempt, meta)
            self._delete(name, keep_attempt=attempt)  # an earlier save of the same name
            if not tag:
                self._prune()
        runtime.barrier()
        return CheckpointInfo(label, step, f"{self.prefix}/{name}", created_at, name)

    def _upload(self, directory: Path, attempt_prefix: str) -> None:
        """Stores this rank's DCP files and then its part (the list of them)."""
        rank = self.runtime.rank
        entries = []
        for path in sorted(directory.iterdir()):
            info = self.store.put(f"{attempt_prefix}/{_object_name(path.name)}", path.read_bytes())
            entries.append(
                ObjectEntry(key=info.key, size=info.size, sha256=info.sha256, shard=rank)
            )
        part = ShardObjects(shard=rank, objects=entries)
        self.store.put(f"{attempt_prefix}/shards/{rank:04d}.json", part.model_dump_json().encode())

    def _write_manifest(self, name: str, attempt: str, meta: dict[str, Any]) -> None:
        """Rank 0, after the barrier: the parts of every rank, then the manifest."""
        parts = []
        for shard in range(self.runtime.world_size):
            key = f"{self.prefix}/{name}/{attempt}/shards/{shard:04d}.json"
            parts.append(ShardObjects.model_validate_json(self.store.get(key)))
        manifest = CheckpointManifest(
            name=name,
            attempt=attempt,
            num_shards=len(parts),
            objects=[entry for part in parts for entry in part.objects],
            **meta,
        )
        self.store.put(self._manifest_key(name), manifest.model_dump_json().encode())

    def _exists(self, name: str) -> bool:
        return self.store.exists(self._manifest_key(name))

    def read_manifest(self, name: str) -> CheckpointManifest:
        """The manifest of the checkpoint ``name``; CheckpointError when absent or malformed."""
        return read_checkpoint_manifest(self.store, self.prefix, name)

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint with a manifest, oldest step first."""
        return list_store_checkpoints(self.store, self.prefix)

    def load(self, info: CheckpointInfo, learner: Learner) -> dict[str, Any]:
        """Restores ``learner`` and the RNGs from ``info`` (collective); returns the job's state."""
        manifest = self.read_manifest(info.name)
        directory = self.staging / f".load-{uuid.uuid4().hex[:16]}-rank{self.runtime.rank:05d}"
        directory.mkdir(parents=True)
        try:
            state = learner_state(learner)
            reader = _StoreReader(self.store, manifest.objects, directory)
            dcp_call(dcp.load, state, storage_reader=reader)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return restore(learner, state, manifest.model_dump(include={"job", "python_rng"}))

    def discard_partial(self) -> None:
        """Rank 0 deletes the objects no manifest lists (saves that died half-way) and the
        local staging; the others wait."""
        if self.runtime.is_leader:
            keys = self.store.list(f"{self.prefix}/")
            names = {key[len(self.prefix) + 1 :].split("/", 1)[0] for key in keys}
            complete = set(manifest_names(keys, self.prefix))
            for name in sorted(names):
                if name in complete:
                    self._delete(name, keep_attempt=self.read_manifest(name).attempt)
                else:
                    self.store.delete([k for k in keys if k.startswith(f"{self.prefix}/{name}/")])
            if self.staging.is_dir():  # what a killed save or resume left
                for path in [*self.staging.glob(".save-*"), *self.staging.glob(".load-*")]:
                    shutil.rmtree(path, ignore_errors=True)
        self.runtime.barrier()

    def _delete(self, name: str, *, keep_attempt: str | None = None) -> None:
        """Deletes the checkpoint ``name`` (manifest first, so that no reader finds a
        manifest whose objects are gone), or only the attempts other than ``keep_attempt``."""
        keys = self.store.list(f"{self.prefix}/{name}/")
        manifest = self._manifest_key(name)
        if keep_attempt is None:
            self.store.delete([manifest])
            self.store.delete([k for k in keys if k != manifest])
            return
        kept = f"{self.prefix}/{name}/{keep_attempt}/"
        self.store.delete([k for k in keys if k != manifest and not k.startswith(kept)])

    def _prune(self) -> None:
        periodic = [c for c in self.list() if c.name.startswith("step-")]
        for old in periodic[: -self.keep_last]:
            self._delete(old.name)
