"""Loading the model straight into this rank's shards.

The model is built on the meta device and laid out for the rank (``parallelize``), so it
holds no weight yet; then each of its tensors is filled with the rows of the checkpoint
its shard holds, read from the safetensors files (``CheckpointReader``, one tensor at a
time). A rank never holds the whole model, nor a float32 copy of the checkpoint: loading
peaks at the rank's shards plus one tensor's rows.

The rows follow FSDP2's sharding, ``torch.chunk`` on dim 0: a dense tensor over all the
ranks of the ``shard`` mesh, an expert tensor over the ``edp`` ranks that hold the same
experts, within this rank's experts on the ``ep`` mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from services.trainer.distributed.expert_parallel import ExpertParallelExperts
from services.trainer.distributed.mesh import Meshes
from services.trainer.distributed.parallelize import parallelize
from services.trainer.model.architecture import Architecture
from services.trainer.model.checkpoint_reader import CheckpointReader, Rows
from services.trainer.model.hf_io import MTP_FILE, load_weights
from services.trainer.model.mtp import MTPHead
from services.trainer.model.transformer import Qwen3MoE


def chunk_rows(num_rows: int, num_chunks: int, index: int) -> Rows:
    """Rows of chunk ``index`` when ``torch.chunk`` cuts ``num_rows`` into ``num_chunks``
    (chunks of ``ceil(num_rows / num_chunks)``; the last ones may be short or empty)."""
    size = -(-num_rows // num_chunks)
    return min(index * size, num_rows), min((index + 1) * size, num_rows)


def shard_rows(model: Qwen3MoE, meshes: Meshes) -> Callable[[str], Rows]:
    """For each tensor name of a parallelized ``model``, the rows this rank holds."""
    experts = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, ExpertParallelExperts)
    }
    num_rows = {name: tensor.shape[0] for name, tensor in model.state_dict().items()}
    edp, shard = meshes.edp_mesh, meshes.shard

    def rows(name: str) -> Rows:
        prefix = name.rpartition(".")[0]
        if prefix in experts:
            module = experts[prefix]
            start, end = chunk_rows(module.num_local_experts, edp.size(), edp.get_local_rank())
            return module.first_local_expert + start, module.first_local_expert + end
        return chunk_rows(num_rows[name], shard.size(), shard.get_local_rank())

    return rows


def fresh_mtp_state(arch: Architecture, num_heads: int, seed: int) -> dict[str, torch.Tensor]:
    """The MTP heads' fresh weights as ``load_pretrained`` draws them (same generator, same
    order), whole: they are small."""
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for index in range(num_heads):
        with torch.device("meta"):
            head = MTPHead(arch)
        head.to_empty(device="cpu")
        head.reset_parameters(generator)
        state |= {f"mtp.{index}.{name}": t for name, t in head.state_dict().items()}
    return state


def load_sharded(
    model_dir: Path,
    meshes: Meshes,
    device: torch.device,
    *,
    seed: int,
    **options: object,
) -> Qwen3MoE:
    """This rank's part of the model in ``model_dir`` (``options``: ``Qwen3MoE``'s keyword
    arguments), its shards read from the checkpoint's files and nothing else."""
    from safetensors.torch import load_file

    arch = Architecture.from_model_dir(model_dir)
    with torch.device("meta"):
        model = Qwen3MoE(arch, **options)  # type: ignore[arg-type]
    model = parallelize(model, meshes, device)
    model.to_empty(device=device)
    mtp = fresh_mtp_state(arch, len(model.mtp), seed)
    mtp_path = Path(model_dir) / MTP_FILE
    if mtp_path.is_file():
        mtp |= {name: t for name, t in load_file(mtp_path).items() if name in mtp}
    with CheckpointReader(model_dir, arch) as reader:
        load_weights(model, reader, mtp, shard_rows(model, meshes))
    return model
