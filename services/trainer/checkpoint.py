"""Checkpoints with torch.distributed.checkpoint: model, optimizers, reference, RNG, cursor.

A checkpoint is a directory: DCP's files (model and optimizer state dicts keyed by
parameter name, the reference model, the torch RNG) and ``etude_checkpoint.json`` (the
step, the tag, the job's own state: data cursor, last published version, the groups
pulled since the last commit, the Python RNG). It is written aside and renamed into
place, so a crash mid-save leaves the previous checkpoint as the newest complete one.
Periodic checkpoints are ``step-<n>`` (the newest ``keep_last`` are kept); tagged ones
(``SaveCheckpoint``) are ``tag-<tag>`` and stay.

Saving is collective: every rank writes its own shards of the model, optimizer and
reference into the same staging directory (one ``.distcp`` file per rank; one in a
single process, where DCP runs without a process group), then rank 0 writes the
metadata, renames and prunes; barriers keep the ranks in step, so every rank sees the
same checkpoints afterwards. Loading is collective too (each rank reads its shards).
The checkpoint directory must be one filesystem for all ranks (one node, or a
ReadWriteMany volume: ``trainer.checkpoints.existingClaim``).

``checkpoint.location`` chooses the backend (``open_checkpoints``): this directory, or
the object store (``services.trainer.checkpoint_objects``: the same DCP files as
objects, a manifest written last), which any node can resume from.
"""

from __future__ import annotations

import abc
import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from services.trainer.checkpoint_index import CheckpointInfo, list_local_checkpoints
from services.trainer.learner import Learner
from services.trainer.paths import (
    META_FILE,
    checkpoint_config,
    checkpoint_prefix,
    checkpoint_root,
    checkpoints_in_store,
)
from services.trainer.runtime import LocalRuntime, TrainerRuntime

if TYPE_CHECKING:
    from services.config.trainer import TrainerProcessConfig
    from services.objectstore.base import ObjectStore

_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def dcp_call(operation: Any, state: dict[str, Any], **where: Any) -> None:
    """``dcp.save`` or ``dcp.load`` (``checkpoint_id`` or a storage reader ``where``); in
    one process without the warning DCP gives for it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        operation(state, no_dist=_no_dist(), **where)


def checkpoint_name(step: int, tag: str | None) -> str:
    """``tag-<tag>`` for a tagged checkpoint, else ``step-<n>``."""
    return f"tag-{tag}" if tag else f"step-{step:08d}"


def job_meta(label: str, step: int, created_at: float, job_state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records besides DCP's files: the step, the job's state, Python's RNG."""
    return {
        "tag": label,
        "step": step,
        "created_at": created_at,
        "job": job_state,
        "python_rng": _encode_random_state(random.getstate()),
    }


def learner_state(learner: Learner) -> dict[str, Any]:
    """The DCP state dict of ``learner`` (templates to load into, or values to save)."""
    model_state, optimizer_state = get_state_dict(learner.model, learner.optimizers)
    state: dict[str, Any] = {
        "model": model_state,
        "optimizers": optimizer_state,
        "rng": {"torch": torch.get_rng_state()},
    }
    if learner.reference is not None:
        state["reference"] = learner.reference.state_dict()
    return state


class Checkpoints(abc.ABC):
    """Where a run's checkpoints live; every rank of ``runtime`` saves and loads together."""

    runtime: TrainerRuntime

    @abc.abstractmethod
    def save(
        self, learner: Learner, job_state: dict[str, Any], *, step: int, tag: str | None = None
    ) -> CheckpointInfo:
        """Writes a checkpoint of ``learner`` after ``step`` completed steps (collective);
        FileExistsError when ``tag`` is taken."""

    @abc.abstractmethod
    def list(self) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest step first."""

    @abc.abstractmethod
    def load(self, info: CheckpointInfo, learner: Learner) -> dict[str, Any]:
        """Restores ``learner`` and the RNGs from ``info`` (collective); returns the job's state."""

    @abc.abstractmethod
    def discard_partial(self) -> None:
        """Rank 0 removes what a crashed save left half-written; the others wait."""

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint with the most steps (the newest among equals)."""
        checkpoints = self.list()
        return checkpoints[-1] if checkpoints else None


def open_checkpoints(
    config: TrainerProcessConfig, store: ObjectStore, runtime: TrainerRuntime | None = None
) -> Checkpoints:
    """The run's checkpoints where ``checkpoint.location`` puts them."""
    keep_last = checkpoint_config(config).keep_last
    if checkpoints_in_store(config):
        from services.trainer.checkpoint_objects import ObjectStoreCheckpoints

        prefix = checkpoint_prefix(config)
        return ObjectStoreCheckpoints(store, prefix, checkpoint_root(config), keep_last, runtime)
    return CheckpointStore(checkpoint_root(config), keep_last, runtime)


class CheckpointStore(Checkpoints):
    """The checkpoints of one run in the directory ``root``, saved by every rank of
    ``runtime``."""

    def __init__(
        self, root: Path, keep_last: int = 3, runtime: TrainerRuntime | None = None
    ) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.runtime = runtime or LocalRuntime()

    def save(
        self, learner: Learner, job_state: dict[str, Any], *, step: int, tag: str | None = None
    ) -> CheckpointInfo:
        """Writes a checkpoint of ``learner`` after ``step`` completed steps (collective)."""
        runtime = self.runtime
        name = checkpoint_name(step, tag)
        final = self.root / name
        # Rank 0 decides, so that no rank writes while another refused.
        if runtime.share(bool(tag) and final.exists()):
            raise FileExistsError(f"checkpoint tag {tag!r} exists ({final})")
        staging = self.root / f".{name}.partial-{runtime.share(os.getpid())}"
        if runtime.is_leader:
            self.root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)
        runtime.barrier()
        dcp_call(dcp.save, learner_state(learner), checkpoint_id=staging)
        created_at = runtime.share(time.time())
        label = tag or name
        if runtime.is_leader:
            self._finish(staging, final, label, step, created_at, job_state, prune=not tag)
        runtime.barrier()
        return CheckpointInfo(label, step, final, created_at, name)

    def _finish(
        self,
        staging: Path,
        final: Path,
        label: str,
        step: int,
        created_at: float,
        job_state: dict[str, Any],
        *,
        prune: bool,
    ) -> None:
        """Writes the metadata into ``staging`` and renames it to ``final`` (durably)."""
        meta = job_meta(label, step, created_at, job_state)
        (staging / META_FILE).write_text(json.dumps(meta))
        _fsync_dir(staging)
        if final.exists():  # a periodic checkpoint of the same step, written again on resume
            shutil.rmtree(final)
        staging.rename(final)
        _fsync_dir(self.root)
        if prune:
            self._prune()

    def discard_partial(self) -> None:
        """Rank 0 removes checkpoints a crashed process left half-written; the others wait."""
        if self.runtime.is_leader and self.root.is_dir():
            for path in self.root.glob(".*.partial-*"):
                shutil.rmtree(path, ignore_errors=True)
        self.runtime.barrier()

    def list(self) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest step first."""
        return list_local_checkpoints(self.root)

    def load(self, info: CheckpointInfo, learner: Learner) -> dict[str, Any]:
        """Restores ``learner`` and the RNGs from ``info``; returns the job's state."""
        location = Path(info.location)
        state = learner_state(learner)
        dcp_call(dcp.load, state, checkpoint_id=location)
        return restore(learner, state, json.loads((location / META_FILE).read_text()))

    def _prune(self) -> None:
        periodic = [c for c in self.list() if c.name.startswith("step-")]
        for old in periodic[: -self.keep_last]:
            shutil.rmtree(old.location, ignore_errors=True)


def restore(learner: Learner, state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Sets ``learner`` and the RNGs from a loaded DCP ``state`` and the checkpoint's
    ``meta`` (``job_meta``); returns the job's state."""
    set_state_dict(
        learner.model,
        learner.optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizers"],
    )
    if learner.reference is not None:
        learner.reference.load_state_dict(state["reference"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(_decode_random_state(meta["python_rng"]))
    job_state: dict[str, Any] = meta["job"]
    return job_state


def _encode_random_state(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _decode_random_state(encoded: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = encoded
    return (version, tuple(internal), gauss)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
