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
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

from services.run_config import EtudeConfig

if TYPE_CHECKING:
    from services.trainer.distributed.runtime import Runtime

log = logging.getLogger(__name__)

_runtime: Runtime | None = None


def launched_distributed() -> bool:
    """Whether torchrun (or another launcher) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def current_runtime() -> Runtime | None:
    """The runtime ``run`` started in this process (None in a single-process trainer)."""
    return _runtime


def run(config: EtudeConfig) -> None:
    """Runs this process's part of the distributed trainer until it ends or is stopped."""
    global _runtime
    from services.trainer.distributed.layout import check_job
    from services.trainer.distributed.runtime import ProcessInfo, start
    from services.trainer.model.architecture import Architecture
    from services.trainer.service import TrainerService
    from services.wire.server import run_service

    info = ProcessInfo.from_env()
    job = config.trainer.job
    if job is None:
        if info.local_rank == 0:
            run_service(TrainerService, config)
        else:
            log.info("no [trainer.job]: local rank %d has nothing to do", info.local_rank)
        return
    model_dir = job.model.model_dir or config.inference.engine.model_dir
    layout = check_job(job, Architecture.from_model_dir(model_dir), info.world_size)
    _runtime = start(layout, backend=job.dist.backend, timeout_s=job.dist.timeout_s, info=info)
    try:
        if _runtime.serves_http:
            run_service(TrainerService, config)
        else:
            asyncio.run(_follow(config, _runtime))
    finally:
        _runtime.close()
        _runtime = None


async def _follow(config: EtudeConfig, runtime: Runtime) -> None:
    from services.objectstore.factory import open_store
    from services.trainer.job import TrainingJob

    job = TrainingJob(config, open_store(config.object_store), None, runtime)
    await job.run()
    if job.state == "failed":
        raise RuntimeError(f"rank {runtime.rank}: the training job failed: {job.error}")
