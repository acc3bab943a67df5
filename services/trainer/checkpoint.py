"""Checkpoints with torch.distributed.checkpoint: model, optimizers, reference, RNG, cursor.

A checkpoint is a directory: DCP's files (model and optimizer state dicts keyed by
parameter name, the reference model, the torch RNG) and ``etude_checkpoint.json`` (the
step, the tag, the job's own state: data cursor, last published version, the groups
pulled since the last commit, the Python RNG). It is written aside and renamed into
place, so a crash mid-save leaves the previous checkpoint as the newest complete one.
Periodic checkpoints are ``step-<n>`` (the newest ``keep_last`` are kept); tagged ones
(``SaveCheckpoint``) are ``tag-<tag>`` and stay. DCP writes from every rank when the
trainer is distributed; in one process it runs without a process group.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from services.trainer.learner import Learner
from services.trainer.paths import META_FILE, checkpoint_dirs

_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    tag: str
    step: int
    location: Path
    created_at: float


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _dcp(operation: Any, state: dict[str, Any], path: Path) -> None:
    """``dcp.save`` or ``dcp.load``; in one process without the warning DCP gives for it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        operation(state, checkpoint_id=path, no_dist=_no_dist())


def _state(learner: Learner) -> dict[str, Any]:
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


class CheckpointStore:
    """The checkpoints of one run under ``root``."""

    def __init__(self, root: Path, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(
        self, learner: Learner, job_state: dict[str, Any], *, step: int, tag: str | None = None
    ) -> CheckpointInfo:
        """Writes a checkpoint of ``learner`` after ``step`` completed steps."""
        name = f"tag-{tag}" if tag else f"step-{step:08d}"
        final = self.root / name
        if tag and final.exists():
            raise FileExistsError(f"checkpoint tag {tag!r} exists ({final})")
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".{name}.partial-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        _dcp(dcp.save, _state(learner), staging)
        created_at = time.time()
        self._finish(staging, final, tag or name, step, created_at, job_state, prune=not tag)
        return CheckpointInfo(tag or name, step, final, created_at)

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
        meta = {
            "tag": label,
            "step": step,
            "created_at": created_at,
            "job": job_state,
            "python_rng": _encode_random_state(random.getstate()),
        }
        (staging / META_FILE).write_text(json.dumps(meta))
        _fsync_dir(staging)
        if final.exists():  # a periodic checkpoint of the same step, written again on resume
            shutil.rmtree(final)
        staging.rename(final)
        _fsync_dir(self.root)
        if prune:
            self._prune()

    def discard_partial(self) -> None:
        """Removes checkpoints a crashed process left half-written."""
        if self.root.is_dir():
            for path in self.root.glob(".*.partial-*"):
                shutil.rmtree(path, ignore_errors=True)

    def list(self) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest step first."""
        found = []
        for path in checkpoint_dirs(self.root):
            meta = json.loads((path / META_FILE).read_text())
            found.append(CheckpointInfo(meta["tag"], int(meta["step"]), path, meta["created_at"]))
        return sorted(found, key=lambda info: (info.step, info.created_at))

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint with the most steps (the newest among equals)."""
        checkpoints = self.list()
        return checkpoints[-1] if checkpoints else None

    def load(self, info: CheckpointInfo, learner: Learner) -> dict[str, Any]:
        """Restores ``learner`` and the RNGs from ``info``; returns the job's state."""
        state = _state(learner)
        _dcp(dcp.load, state, info.location)
        set_state_dict(
            learner.model,
            learner.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizers"],
        )
        if learner.reference is not None:
            learner.reference.load_state_dict(state["reference"])
        torch.set_rng_state(state["rng"]["torch"])
        meta = json.loads((info.location / META_FILE).read_text())
        random.setstate(_decode_random_state(meta["python_rng"]))
        job_state: dict[str, Any] = meta["job"]
        return job_state

    def _prune(self) -> None:
        periodic = [c for c in self.list() if c.location.name.startswith("step-")]
        for old in periodic[: -self.keep_last]:
            shutil.rmtree(old.location, ignore_errors=True)


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
