"""Loading straight into each rank's shards (``Runtime.load_model``) gives every rank
exactly the shards that loading the whole model and then sharding it gives, for dense
and expert tensors, MTP heads included; in gloo processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from services.trainer.distributed.layout import ParallelLayout
from services.trainer.distributed.loading import chunk_rows
from services.trainer.distributed.parallelize import parallelize
from services.trainer.distributed.runtime import ProcessInfo, start
from services.trainer.model import Architecture, load_pretrained
from services.wire.ports import free_port


def test_chunk_rows_follow_torch_chunk() -> None:
    for num_rows in (1, 5, 8, 13):
        for num_chunks in (1, 2, 3, 4):
            pieces = torch.arange(num_rows).chunk(num_chunks)
            for index in range(num_chunks):
                start, end = chunk_rows(num_rows, num_chunks, index)
                expected = pieces[index].tolist() if index < len(pieces) else []
                assert list(range(start, end)) == expected


def _worker(rank: int, world_size: int, port: int, model_dir: str, dp: int, ep: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    arch = Architecture.from_model_dir(Path(model_dir))
    layout = ParallelLayout.resolve(world_size, dp=dp, cp=1, ep=ep, num_experts=arch.num_experts)
    runtime = start(layout, backend="gloo", timeout_s=120, info=ProcessInfo(rank, rank, world_size))
    try:
        options = {"dtype": torch.float32, "num_mtp_heads": 1}
        sharded = runtime.load_model(Path(model_dir), seed=3, **options)
        whole = parallelize(
            load_pretrained(Path(model_dir), seed=3, **options), runtime.meshes, runtime.device
        )
        expected = whole.state_dict()
        for name, tensor in sharded.state_dict().items():
            assert isinstance(tensor, DTensor), name
            assert tensor.placements == expected[name].placements, name
            assert torch.equal(tensor.to_local(), expected[name].to_local()), name
    finally:
        runtime.close()


@pytest.mark.parametrize(("dp", "ep"), [(2, 1), (2, 2)], ids=["dp2", "ep2"])
def test_each_rank_loads_exactly_its_shards(tiny_model: Path, dp: int, ep: int) -> None:
    mp.spawn(_worker, args=(2, free_port(), str(tiny_model), dp, ep), nprocs=2, join=True)
