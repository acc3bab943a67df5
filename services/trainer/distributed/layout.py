"""The parallel layout: which rank holds which data and which experts (no torch here).

Ranks form a ``dp x cp`` grid, cp innermost: rank ``r`` is data-parallel replica
``r // cp`` and context-parallel position ``r % cp``, so the ranks sharing a sequence are
neighbours (one node, the fastest links). Expert parallelism is not a third axis: the
same ``world = dp * cp`` ranks are regrouped as ``edp x ep``, ep innermost, so an EP
group is ``ep`` consecutive ranks (the cp ranks of one or more dp replicas, or part of
them). Each EP group holds every expert once (``num_experts / ep`` per rank); the
``edp = world / ep`` groups hold copies whose gradients are summed. Nothing is tied to
tensor parallelism, which the trainer does not use.

``ParallelLayout.resolve`` checks the degrees against the world size and the model
before any process group exists, so a bad layout is a clear error at start-up rather
than a collective that hangs.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.config.trainer import JobConfig
from services.trainer.model.architecture import Architecture


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of a run: ``world_size = dp * cp``; ``ep`` divides ``world_size``."""

    world_size: int
    dp: int
    cp: int
    ep: int

    @classmethod
    def resolve(
        cls, world_size: int, *, dp: int = 0, cp: int = 1, ep: int = 1, num_experts: int
    ) -> ParallelLayout:
        """The layout for ``world_size`` processes; ``dp = 0`` takes ``world_size / cp``.

        Raises ``ValueError`` naming the setting and the allowed values when the degrees
        do not tile the world or the experts.
        """
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        if cp < 1 or ep < 1 or dp < 0:
            raise ValueError(f"dist degrees must be positive, got dp={dp}, cp={cp}, ep={ep}")
        if world_size % cp:
            raise ValueError(
                f"dist.cp ({cp}) must divide the world size ({world_size} processes); "
                f"allowed: {_divisors(world_size)}"
            )
        dp = dp or world_size // cp
        if dp * cp != world_size:
            raise ValueError(
                f"dist.dp x dist.cp ({dp} x {cp} = {dp * cp}) must equal the world size "
                f"({world_size} processes); set dp = 0 to derive it"
            )
        if world_size % ep:
            raise ValueError(
                f"dist.ep ({ep}) must divide the world size ({world_size} = dp {dp} x cp {cp}), "
                f"since expert groups are formed from those ranks; allowed: "
                f"{_divisors(world_size)}"
            )
        if num_experts % ep:
            raise ValueError(
                f"the model's num_experts ({num_experts}) must be divisible by dist.ep ({ep}); "
                f"allowed: {[d for d in _divisors(world_size) if num_experts % d == 0]}"
            )
        return cls(world_size, dp, cp, ep)

    @property
    def edp(self) -> int:
        """Copies of each expert (the expert-data-parallel degree)."""
        return self.world_size // self.ep

    @property
    def is_single_process(self) -> bool:
        """One process: no process group, no sharding."""
        return self.world_size == 1

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica of ``rank`` (which sequences it trains on)."""
        return rank // self.cp

    def cp_index(self, rank: int) -> int:
        """The context-parallel position of ``rank`` (which chunks of each sequence)."""
        return rank % self.cp

    def ep_index(self, rank: int) -> int:
        """The position of ``rank`` in its expert group (which experts it holds)."""
        return rank % self.ep

    def edp_index(self, rank: int) -> int:
        """Which copy of the experts ``rank`` belongs to."""
        return rank // self.ep

    def local_experts(self, rank: int, num_experts: int) -> range:
        """The global ids of the experts ``rank`` holds."""
        per_rank = num_experts // self.ep
        start = self.ep_index(rank) * per_rank
        return range(start, start + per_rank)

    def describe(self) -> str:
        """``dp=2 cp=2 ep=4 (edp=1)`` for logs."""
        return f"dp={self.dp} cp={self.cp} ep={self.ep} (edp={self.edp})"


def check_job(job: JobConfig, arch: Architecture, world_size: int) -> ParallelLayout:
    """The layout of ``job`` on ``world_size`` processes, or ``ValueError`` saying what
    does not fit (before any process group exists)."""
    dist = job.dist
    layout = ParallelLayout.resolve(
        world_size, dp=dist.dp, cp=dist.cp, ep=dist.ep, num_experts=arch.num_experts
    )
    if layout.cp > 1 and job.model.num_mtp_heads:
        raise ValueError(
            f"model.num_mtp_heads ({job.model.num_mtp_heads}) needs each sequence whole on one "
            f"rank; set it to 0 or dist.cp ({layout.cp}) to 1"
        )
    return layout


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
