"""Loading straight into each rank's shards (``Runtime.load_model``) gives every rank
exactly the shards that loading the whole model and then sharding it gives, for dense
and expert tensors, MTP heads included; and the ranks' served shards
(``Runtime.served_weights``) are together exactly the one-process served weights, the
first MTP head's draft included, each tensor from one rank; in gloo processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from services.draft_layout import DRAFT_PREFIX
from services.trainer.distributed.layout import ParallelLayout
from services.trainer.distributed.loading import chunk_rows
from services.trainer.distributed.parallelize import parallelize
from services.trainer.distributed.runtime import ProcessInfo, start
from services.trainer.model import Architecture, load_pretrained, to_hf
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
        served = runtime.served_weights(sharded)
        reference = to_hf(load_pretrained(Path(model_dir), seed=3, **options), draft=True)
        assert any(name.startswith(DRAFT_PREFIX) for name in reference)
        for name, tensor in served.items():
            assert torch.equal(tensor, reference[name]), name
        names: list[list[str] | None] = [None] * world_size
        torch.distributed.all_gather_object(names, sorted(served))
        assert sum(len(part or []) for part in names) == len(reference)
        assert set().union(*(part or [] for part in names)) == set(reference)
    finally:
        runtime.close()


@pytest.mark.parametrize(("dp", "ep"), [(2, 1), (2, 2)], ids=["dp2", "ep2"])
def test_each_rank_loads_exactly_its_shards(tiny_model: Path, dp: int, ep: int) -> None:
    mp.spawn(_worker, args=(2, free_port(), str(tiny_model), dp, ep), nprocs=2, join=True)
