"""A process's place in a distributed job: its process group, meshes, device, and the
job's collectives outside the model (plans, metrics, gradient norm).

``start`` reads what torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``), checks the layout against the world size and the model
(``ParallelLayout.resolve``, before any collective), joins the process group (gloo on
CPU, NCCL with one GPU per process) and builds the meshes. Control messages (the step
plan from rank 0) always travel over a gloo group, so they stay on the CPU with NCCL.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from services.config.trainer import JobConfig
from services.trainer.distributed.layout import ParallelLayout
from services.trainer.distributed.mesh import Meshes, build_meshes
from services.trainer.runtime import TrainerRuntime

if TYPE_CHECKING:
    from services.trainer.model import Qwen3MoE
    from services.trainer.planning import StepPlanner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessInfo:
    """What torchrun tells a worker about itself."""

    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_env(cls) -> ProcessInfo:
        """From ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (one process when unset)."""
        values = {}
        for name, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            raw = os.environ.get(name, default)
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
        info = cls(values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"])
        if not 0 <= info.rank < info.world_size:
            raise ValueError(f"RANK={info.rank} is outside [0, WORLD_SIZE={info.world_size})")
        return info


class Runtime(TrainerRuntime):
    """One process of a distributed job: its process group, meshes and device."""

    def __init__(
        self, info: ProcessInfo, meshes: Meshes, device: torch.device, control: dist.ProcessGroup
    ) -> None:
        self.info, self.meshes, self.layout = info, meshes, meshes.layout
        self.device = device
        self._control = control

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.info.rank

    @property
    def local_rank(self) -> int:
        """Rank within this node."""
        return self.info.local_rank

    def share(self, message: Any) -> Any:
        """Rank 0's ``message`` on every rank (the others pass None)."""
        box = [message if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def scatter(self, messages: list[Any] | None) -> Any:
        """Rank 0's ``messages[rank]`` on each rank (the others pass None)."""
        box: list[Any] = [None]
        dist.scatter_object_list(
            box, messages if self.is_leader else None, src=0, group=self._control
        )
        return box[0]

    def barrier(self) -> None:
        """Waits for every rank."""
        dist.barrier(group=self._control)

    def all_reduce(self, values: list[float], op: Literal["sum", "max"] = "sum") -> list[float]:
        """``values`` summed (or maxed) elementwise over every rank."""
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.float64)
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        dist.all_reduce(tensor, op=reduce_op, group=self._control)
        return [float(value) for value in tensor.tolist()]

    def clip_and_step(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], max_grad_norm: float
    ) -> float:
        """``services.trainer.optim.clip_and_step`` over sharded gradients.

        Every weight is sharded (FSDP2 over the dense mesh, or the 2-D expert mesh), each
        element on exactly one rank, so the global norm is the square root of the sum of
        every rank's local sums of squares. ``clip_grad_norm_`` cannot take gradients of
        two meshes at once. Clipping follows it: scale by ``min(1, max / (norm + 1e-6))``.
        """
        grads = []
        for name, param in model.named_parameters():
            if param.grad is None:
                continue
            if not isinstance(param.grad, DTensor):
                raise TypeError(f"{name}: expected a sharded (DTensor) gradient")
            grads.append(param.grad.to_local())
        squares = sum(float(g.double().square().sum()) for g in grads)
        norm = self.all_reduce([squares])[0] ** 0.5
        if max_grad_norm > 0:
            scale = min(1.0, max_grad_norm / (norm + 1e-6))
            for grad in grads:
                grad.mul_(scale)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return norm

    def parallelize(self, model: Qwen3MoE) -> Qwen3MoE:
        """``model`` sharded over the meshes (FSDP2, context and expert parallelism)."""
        from services.trainer.distributed.parallelize import parallelize

        return parallelize(model, self.meshes, self.device)

    def load_model(self, model_dir: Path, *, seed: int, **options: Any) -> Qwen3MoE:
        """This rank's shards only, read from the checkpoint's files
        (``loading.load_sharded``): no rank holds the whole model."""
        from services.trainer.distributed.loading import load_sharded

        return load_sharded(model_dir, self.meshes, self.device, seed=seed, **options)

    def served_weights(self, model: Qwen3MoE) -> dict[str, torch.Tensor]:
        """This rank's shard of the served weights (``publishing.shard_tensors``)."""
        from services.trainer.distributed.publishing import shard_tensors

        return shard_tensors(model, self)

    def export(self, model: Qwen3MoE, out: Path, *, source_dir: Path, policy_version: int) -> None:
        """The full state gathered on rank 0, which writes it (``publishing.export_pretrained``)."""
        from services.trainer.distributed.publishing import export_pretrained

        export_pretrained(
            model, out, source_dir=source_dir, policy_version=policy_version, runtime=self
        )

    def planner(self, job: JobConfig, model: Qwen3MoE) -> StepPlanner:
        """Global cost-balanced packing with the settings' cost model, or one rank 0
        measures on this model and shares."""
        from services.trainer.distributed.batching import BalancedPlanner
        from services.trainer.distributed.calibration import calibrate
        from services.trainer.distributed.packing import CostModel
        from services.trainer.model import resolve_experts_precision

        packing = job.dist.packing
        cost_model: CostModel | None = None
        if packing.calibrate and self.is_leader:
            cost_model = calibrate(
                model.arch,
                dtype=model.dtype,
                precision=resolve_experts_precision(
                    job.model.experts_precision, model.dtype, job.model.experts_backend
                ),
                device=self.device,
            )
            log.info("packing cost measured: b / a = %.3g", cost_model.per_token_pair)
        elif not packing.calibrate:
            cost_model = CostModel(packing.cost_per_token, packing.cost_per_token_pair)
        shared: CostModel = self.share(cost_model)
        return BalancedPlanner(
            self.layout, self.cp_index, shared, model.arch, share_prefixes=job.shares_prefixes
        )

    def close(self) -> None:
        """Leaves the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()


def choose_backend(setting: str) -> Literal["gloo", "nccl"]:
    """``auto``: NCCL when CUDA is available, gloo otherwise."""
    if setting == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if setting == "nccl" and not torch.cuda.is_available():
        raise ValueError("dist.backend = 'nccl' needs CUDA, which this machine does not have")
    if setting not in ("gloo", "nccl"):
        raise ValueError(f"dist.backend must be 'auto', 'gloo' or 'nccl', got {setting!r}")
    return "nccl" if setting == "nccl" else "gloo"


def start(
    layout: ParallelLayout,
    *,
    backend: str = "auto",
    timeout_s: float = 1800.0,
    info: ProcessInfo | None = None,
) -> Runtime:
    """Joins the process group of a checked ``layout`` and builds its meshes."""
    info = info or ProcessInfo.from_env()
    if info.world_size != layout.world_size:
        raise ValueError(
            f"the layout is for {layout.world_size} processes, this job has {info.world_size}"
        )
    chosen = choose_backend(backend)
    if chosen == "nccl":
        torch.cuda.set_device(info.local_rank)
        device = torch.device("cuda", info.local_rank)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(chosen, rank=info.rank, world_size=info.world_size, timeout=timeout)
    control = (
        dist.group.WORLD if chosen == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    )
    assert control is not None
    meshes = build_meshes(layout, device.type)
    log.info(
        "rank %d/%d (local %d) joined: %s, %s on %s",
        info.rank,
        info.world_size,
        info.local_rank,
        layout.describe(),
        chosen,
        device,
    )
    return Runtime(info, meshes, device, control)
