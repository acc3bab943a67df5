"""Device meshes of a layout: ``(dp, cp)`` for dense layers, ``(edp, ep)`` for experts.

Both meshes cover the same ``world = dp * cp`` ranks, in the order
``services.trainer.distributed.layout`` defines:

* ``dense``  — ``(dp, cp)``; ``dense["cp"]`` is the group that shares sequences
  (context-parallel attention), ``dense["dp"]`` the replicas that see different ones;
* ``shard``  — the same ranks as one flat axis ``dp_cp``: dense weights are sharded over
  all of them (FSDP2), since every rank, whether it differs by data or by context,
  contributes to every dense gradient;
* ``expert`` — ``(edp, ep)``: experts are split over ``ep`` and FSDP-sharded over ``edp``
  (the ranks holding the same experts), so each expert weight lives on exactly one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from services.trainer.distributed.layout import ParallelLayout


@dataclass(frozen=True)
class Meshes:
    """The device meshes of one process (every rank builds the same ones, in order)."""

    layout: ParallelLayout
    dense: DeviceMesh
    shard: DeviceMesh
    expert: DeviceMesh

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The ranks that hold the chunks of the same sequences."""
        return self.dense["cp"].get_group()

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks that together hold every expert once."""
        return self.expert["ep"]

    @property
    def edp_mesh(self) -> DeviceMesh:
        """The ranks that hold the same experts."""
        return self.expert["edp"]


def build_meshes(layout: ParallelLayout, device_type: str) -> Meshes:
    """Creates the meshes (a collective: every rank calls it with the same layout)."""
    if not dist.is_initialized() or dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"build_meshes needs an initialized process group of {layout.world_size} ranks"
        )
    dense = init_device_mesh(device_type, (layout.dp, layout.cp), mesh_dim_names=("dp", "cp"))
    shard = init_device_mesh(device_type, (layout.world_size,), mesh_dim_names=("dp_cp",))
    expert = init_device_mesh(device_type, (layout.edp, layout.ep), mesh_dim_names=("edp", "ep"))
    return Meshes(layout, dense, shard, expert)
