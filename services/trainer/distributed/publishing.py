"""Publishing and exporting the weights of a sharded model.

**Publishing** (``services.trainer.publishing``): every rank publishes one shard of each
version (``WeightPublisher(shard=rank, num_shards=world)``): the experts it holds (the
ranks of the first expert copy, ``edp`` index 0, publish theirs) and a share of the dense
tensors, gathered whole and given out so that every rank uploads about as many bytes
(``shard_tensors``). Gathering is collective, so every rank publishes every version.

**Exporting** (``export_dir``): the full state dict is gathered on rank 0, which writes
the HF model directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from services.draft_layout import is_draft_head
from services.trainer.distributed.runtime import Runtime
from services.trainer.model import Qwen3MoE, save_pretrained
from services.trainer.model.hf_io import state_to_hf

_EXPERT_SUFFIXES = (".mlp.experts.gate_up", ".mlp.experts.down")


def shard_tensors(model: Qwen3MoE, runtime: Runtime) -> dict[str, torch.Tensor]:
    """This rank's shard of the served weights, under HF names, in bf16 (collective)."""
    layout, rank = runtime.layout, runtime.rank
    # The first MTP head goes with the dense tensors: the served draft (state_to_hf).
    state = {
        name: t
        for name, t in model.state_dict().items()
        if not name.startswith("mtp.") or is_draft_head(name)
    }
    experts = sorted(name for name in state if name.endswith(_EXPERT_SUFFIXES))
    dense = sorted(name for name in state if name not in experts)
    mine: dict[str, torch.Tensor] = {}
    expert_bytes = 0
    for name in experts:
        tensor = state[name]
        assert isinstance(tensor, DTensor)
        # Whole over edp, still split over ep: this rank's experts, gathered from its copies.
        local = tensor.redistribute(tensor.device_mesh, [Replicate(), Shard(0)]).to_local()
        if layout.edp_index(rank) == 0:
            mine[name] = local.cpu()
            expert_bytes += local.numel()
    # The dense tensors are given out by size; expert holders start with their experts.
    sizes = np.array([float(state[name].numel()) for name in dense])
    owners = _balanced_owners(sizes, runtime, expert_bytes)
    for name, owner in zip(dense, owners, strict=True):
        tensor = state[name]
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if owner == rank:
            mine[name] = whole.cpu()
    first_expert = layout.local_experts(rank, model.arch.num_experts).start
    return state_to_hf(mine, model.arch, torch.bfloat16, first_expert=first_expert, draft=True)


def _balanced_owners(sizes: np.ndarray, runtime: Runtime, own_bytes: int) -> list[int]:
    """The rank that publishes each dense tensor: largest first, to the least loaded rank."""
    loads = runtime.all_reduce(
        [float(own_bytes) if r == runtime.rank else 0.0 for r in range(runtime.world_size)]
    )
    owners = [0] * len(sizes)
    for index in np.argsort(-sizes, kind="stable"):
        owner = int(np.argmin(loads))  # the lowest rank among equals: the same on every rank
        owners[int(index)] = owner
        loads[owner] += float(sizes[index])
    return owners


def export_pretrained(
    model: Qwen3MoE, out: Path, *, source_dir: Path, policy_version: int, runtime: Runtime
) -> None:
    """Rank 0 writes the whole model as an HF directory (collective: every rank calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if runtime.is_leader:
        with torch.device("meta"):
            whole = Qwen3MoE(model.arch, dtype=model.dtype, num_mtp_heads=len(model.mtp))
        whole.to_empty(device="cpu")
        whole.load_state_dict(state)
        save_pretrained(whole, out, source_dir=source_dir, policy_version=policy_version)
    runtime.barrier()
