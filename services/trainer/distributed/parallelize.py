"""Turns a loaded ``Qwen3MoE`` into this rank's part of the distributed model.

In order:

1. **experts**: each layer's ``MoEExperts`` becomes ``ExpertParallelExperts`` holding
   this rank's ``num_experts / ep`` experts (a DTensor sharded over ``ep``);
2. **context parallelism** (cp > 1): each attention's core becomes
   ``ContextParallelAttention`` over the rank's cp group;
3. **FSDP2** (``fully_shard``): the experts of each layer over ``edp`` (the ranks that
   hold the same experts), each decoder layer's dense weights and then the rest
   (embeddings, final norm, head, MTP heads) over all ranks. Dense weights are gathered
   in the compute dtype (the model casts each weight to it at use anyway, so the math is
   the single-process math); expert weights in float32, because the precision recipe
   quantizes the master weights. Gradients are reduced in float32 and **summed**, not
   averaged: each rank's loss is already its share of the step's loss (the step's
   normalizer is global), so the sum is the single-process gradient. gloo has no
   ``PREMUL_SUM``, so the sum is forced (``set_force_sum_reduction_for_comms``).

``logits`` and ``mtp_loss`` are registered as FSDP forward methods: they read weights
of the root module outside ``forward``.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from services.trainer.distributed.context_parallel import ContextParallelAttention
from services.trainer.distributed.expert_parallel import ExpertParallelExperts
from services.trainer.distributed.mesh import Meshes
from services.trainer.model.transformer import DecoderLayer, Qwen3MoE
from services.trainer.precision import MoEExperts


def parallelize(model: Qwen3MoE, meshes: Meshes, device: torch.device) -> Qwen3MoE:
    """Shards ``model`` in place for this rank (every rank calls it on the same weights).

    A model on the meta device stays there: ``model.to_empty(device=...)`` then gives each
    shard its storage, for ``services.trainer.distributed.loading`` to fill."""
    layout = meshes.layout
    if layout.cp > 1 and len(model.mtp):
        raise ValueError(
            f"MTP heads (num_mtp_heads = {len(model.mtp)}) need each sequence whole on one "
            f"rank; they do not run with context parallelism (dist.cp = {layout.cp})"
        )
    if not any(param.is_meta for param in model.parameters()):
        model.to(device)  # a model built on the meta device gets its storage after
    cp_mesh = meshes.dense["cp"]
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        experts = layer.mlp.experts
        assert isinstance(experts, MoEExperts)
        layer.mlp.experts = ExpertParallelExperts(experts, meshes.ep_mesh)
        if layout.cp > 1:
            layer.self_attn.core = ContextParallelAttention(
                cp_mesh.get_group(), cp_mesh.get_local_rank(), layout.cp
            )
    dense = MixedPrecisionPolicy(
        param_dtype=model.dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    expert = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        fully_shard(layer.mlp.experts, mesh=meshes.edp_mesh, mp_policy=expert)
        fully_shard(layer, mesh=meshes.shard, mp_policy=dense)
    fully_shard(model, mesh=meshes.shard, mp_policy=dense)
    register_fsdp_forward_method(model, "logits")
    register_fsdp_forward_method(model, "mtp_loss")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
