"""A trainer process's place in its job: which rank it is, and the job's collectives.

The training job is written once, for any number of processes: rank 0 pulls work and
plans each step, ``scatter`` hands every rank its share, metrics and gradient norms go
through ``all_reduce``, checkpoints and published versions are written in shards.
``LocalRuntime`` is that job in one process (rank 0 of a world of 1: every collective
is a pass-through, the model is whole, there is one shard); the distributed runtime
(``services.trainer.distributed.runtime``) runs it under torchrun. The trainer builds its
runtime once at start and hands it to what needs it.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from services.config.trainer import JobConfig
from services.trainer.distributed.layout import ParallelLayout
from services.trainer.optim import clip_and_step

if TYPE_CHECKING:
    from services.trainer.model import Qwen3MoE
    from services.trainer.planning import StepPlanner


class TrainerRuntime(abc.ABC):
    """The processes of one training job, as this one sees them."""

    layout: ParallelLayout
    device: torch.device

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """Global rank."""

    @property
    @abc.abstractmethod
    def local_rank(self) -> int:
        """Rank within this node."""

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self.layout.world_size

    @property
    def is_leader(self) -> bool:
        """Global rank 0: pulls work, serves the API, writes manifests and checkpoint metadata."""
        return self.rank == 0

    @property
    def serves_http(self) -> bool:
        """Local rank 0: the process of a node that answers its pod's probes and metrics."""
        return self.local_rank == 0

    @property
    def dp_index(self) -> int:
        """This rank's data-parallel replica."""
        return self.layout.dp_index(self.rank)

    @property
    def cp_index(self) -> int:
        """This rank's position in its context-parallel group."""
        return self.layout.cp_index(self.rank)

    @abc.abstractmethod
    def share(self, message: Any) -> Any:
        """Rank 0's ``message`` on every rank (the others pass None)."""

    @abc.abstractmethod
    def scatter(self, messages: list[Any] | None) -> Any:
        """Rank 0's ``messages[rank]`` on each rank (the others pass None)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Waits for every rank."""

    @abc.abstractmethod
    def all_reduce(self, values: list[float], op: Literal["sum", "max"] = "sum") -> list[float]:
        """``values`` summed (or maxed) elementwise over every rank."""

    @abc.abstractmethod
    def clip_and_step(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], max_grad_norm: float
    ) -> float:
        """Clips the gradients to ``max_grad_norm`` (0: no clipping) by their global norm,
        steps and zeroes every optimizer; returns the norm before clipping."""

    @abc.abstractmethod
    def parallelize(self, model: Qwen3MoE) -> Qwen3MoE:
        """``model`` laid out over the ranks (this rank's shards), on this rank's device."""

    def load_model(self, model_dir: Path, *, seed: int, **options: Any) -> Qwen3MoE:
        """The model of ``model_dir`` laid out for this rank (``options``: ``Qwen3MoE``'s
        keyword arguments; ``seed`` draws MTP heads the checkpoint lacks). Here: loaded
        whole, a tensor at a time, then ``parallelize``."""
        from services.trainer.model import load_pretrained

        return self.parallelize(load_pretrained(model_dir, seed=seed, **options))

    @abc.abstractmethod
    def served_weights(self, model: Qwen3MoE) -> dict[str, torch.Tensor]:
        """This rank's shard of the weights inference serves (HF names, bf16; collective)."""

    @abc.abstractmethod
    def export(self, model: Qwen3MoE, out: Path, *, source_dir: Path, policy_version: int) -> None:
        """Writes the whole model as an HF directory from rank 0 (collective)."""

    @abc.abstractmethod
    def planner(self, job: JobConfig, model: Qwen3MoE) -> StepPlanner:
        """How this job's steps are cut into each rank's microbatches."""

    def close(self) -> None:  # noqa: B027 - a single process holds nothing to release
        """Releases what joining the job acquired."""


class LocalRuntime(TrainerRuntime):
    """The job in one process: rank 0 of 1, collectives are pass-throughs, one shard."""

    def __init__(self) -> None:
        self.layout = ParallelLayout(world_size=1, dp=1, cp=1, ep=1)
        self.device = torch.device("cpu")

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def local_rank(self) -> int:
        """Always 0."""
        return 0

    def share(self, message: Any) -> Any:
        """``message`` itself."""
        return message

    def scatter(self, messages: list[Any] | None) -> Any:
        """The only message."""
        assert messages is not None and len(messages) == 1
        return messages[0]

    def barrier(self) -> None:
        """Nothing to wait for."""

    def all_reduce(self, values: list[float], op: Literal["sum", "max"] = "sum") -> list[float]:
        """``values`` themselves."""
        return values

    def clip_and_step(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], max_grad_norm: float
    ) -> float:
        """``services.trainer.optim.clip_and_step``."""
        return clip_and_step(model, optimizers, max_grad_norm)

    def parallelize(self, model: Qwen3MoE) -> Qwen3MoE:
        """``model`` as it is (whole, on the CPU)."""
        return model

    def served_weights(self, model: Qwen3MoE) -> dict[str, torch.Tensor]:
        """Every served weight, the first MTP head's as the draft when the model has one."""
        from services.trainer.model import to_hf

        return to_hf(model, draft=True)

    def export(self, model: Qwen3MoE, out: Path, *, source_dir: Path, policy_version: int) -> None:
        """``save_pretrained``."""
        from services.trainer.model import save_pretrained

        save_pretrained(model, out, source_dir=source_dir, policy_version=policy_version)

    def planner(self, job: JobConfig, model: Qwen3MoE) -> StepPlanner:
        """Sequences packed in order, every microbatch on this process."""
        from services.trainer.planning import InOrderPlanner

        return InOrderPlanner(model.arch, share_prefixes=job.shares_prefixes)
