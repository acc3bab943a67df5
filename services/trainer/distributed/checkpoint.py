"""Checkpoints of a distributed job: every rank writes its shards, rank 0 the rest.

The layout on disk is the single-process one (``services.trainer.checkpoint``): DCP
files and ``etude_checkpoint.json`` in a directory written aside and renamed into
place. Here every rank writes its own shards of the model, optimizer and reference
into the same staging directory (one ``.distcp`` file per rank), then rank 0 writes the
metadata, renames, and prunes; barriers keep the ranks in step, so every rank sees the
same checkpoints afterwards. Loading needs no change: ``dcp.load`` is collective and
each rank reads its shards. The checkpoint directory must be one filesystem for all
ranks (one node, or a ReadWriteMany volume: ``trainer.checkpoints.existingClaim``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from services.trainer.checkpoint import (
    CheckpointInfo,
    CheckpointStore,
    _state,
)
from services.trainer.distributed.runtime import Runtime
from services.trainer.learner import Learner


class DistributedCheckpointStore(CheckpointStore):
    """``CheckpointStore`` whose saves are collective (every rank calls them together)."""

    def __init__(self, root: Path, keep_last: int, runtime: Runtime) -> None:
        super().__init__(root, keep_last)
        self.runtime = runtime

    def save(
        self, learner: Learner, job_state: dict[str, Any], *, step: int, tag: str | None = None
    ) -> CheckpointInfo:
        """Writes a checkpoint of ``learner`` after ``step`` completed steps (collective)."""
        name = f"tag-{tag}" if tag else f"step-{step:08d}"
        final = self.root / name
        # Rank 0 decides, so that no rank writes while another refused.
        exists = self.runtime.share(bool(tag) and final.exists())
        if exists:
            raise FileExistsError(f"checkpoint tag {tag!r} exists ({final})")
        staging = self.root / f".{name}.partial-dist"
        if self.runtime.is_leader:
            self.root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)
        self.runtime.barrier()
        dcp.save(_state(learner), checkpoint_id=staging)
        created_at = self.runtime.share(time.time())
        label = tag or name
        if self.runtime.is_leader:
            self._finish(staging, final, label, step, created_at, job_state, prune=not tag)
        self.runtime.barrier()
        return CheckpointInfo(label, step, final, created_at)

    def discard_partial(self) -> None:
        """Rank 0 removes half-written checkpoints; the others wait for it."""
        if self.runtime.is_leader:
            super().discard_partial()
        self.runtime.barrier()
