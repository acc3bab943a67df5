"""``etude serve trainer`` under torchrun: one process per device, one job.

``torchrun --nproc-per-node N --no-python etude serve trainer --config FILE`` (what the
Helm chart's StatefulSet runs on every node) starts N processes per node. Each one:

1. checks the job's layout against the world size and the model
   (``layout.check_job``), so a bad layout fails at start-up on every rank before any
   collective could hang;
2. joins the process group and builds the meshes (``runtime.start``);
3. by role: **global rank 0** serves the trainer's API (gRPC, HTTP), pulls from the
   reconciler, plans each step, commits, writes manifests and checkpoint metadata;
   **local rank 0 of the other nodes** serves the same listeners for its pod's probes
   and metrics (its SaveCheckpoint refuses: requests go to rank 0); **every other
   process** runs the job without listeners. All ranks train.

Without ``[trainer.job]`` only local rank 0 serves (an idle trainer); the others exit.
``services.trainer.service.run`` asks ``start_runtime`` for the process's runtime once
(a ``LocalRuntime`` when no launcher started several processes) and hands it to the
service, or to ``train_without_listeners``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

from services.config.trainer import TrainerProcessConfig

if TYPE_CHECKING:
    from services.trainer.runtime import TrainerRuntime

log = logging.getLogger(__name__)


def launched_distributed() -> bool:
    """Whether torchrun (or another launcher) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_rank() -> int:
    """This process's rank within its node (0 when no launcher set ``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def start_runtime(config: TrainerProcessConfig) -> TrainerRuntime:
    """The runtime of this process's part of the job: ``LocalRuntime`` in one process;
    under torchrun the job's layout is checked (on every rank, before any collective)
    and the process joins the group."""
    from services.trainer.distributed.layout import check_job
    from services.trainer.distributed.runtime import ProcessInfo, start
    from services.trainer.model.architecture import Architecture
    from services.trainer.runtime import LocalRuntime

    job = config.trainer.job
    if job is None or not launched_distributed():
        return LocalRuntime()
    info = ProcessInfo.from_env()
    model_dir = job.model.model_dir or config.model.directory
    layout = check_job(job, Architecture.from_model_dir(model_dir), info.world_size)
    return start(layout, backend=job.dist.backend, timeout_s=job.dist.timeout_s, info=info)


async def train_without_listeners(config: TrainerProcessConfig, runtime: TrainerRuntime) -> None:
    """This rank's part of the job, on a process that serves nothing (not local rank 0)."""
    from services.objectstore.factory import open_store
    from services.trainer.job import TrainingJob

    store = open_store(config.object_store)
    job = await asyncio.to_thread(TrainingJob.build, config, store, None, runtime)
    await job.run()
    if job.state == "failed":
        raise RuntimeError(f"rank {runtime.rank}: the training job failed: {job.error}")
