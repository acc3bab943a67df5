"""Peak memory per rank of loading the trainer's policy and reference, before and after
loading went shard by shard: ``python -m services.bench.trainer_memory [preset] [world]``.

Each way runs in its own ``world`` gloo processes (dp = ep = world: dense weights and
experts both sharded over every rank) on a fresh factory model of ``preset`` (default
``small``), and prints one JSON object: each rank's peak resident memory added by the
load (MiB) and the model's float32 size.

* **whole** (how ``Learner.load`` loaded before): every rank reads the whole checkpoint
  (``read_safetensors``), converts it to a float32 state dict, loads it into a whole
  model, deep-copies that for the reference, then shards both (``parallelize``);
* **sharded** (now): ``Runtime.load_model`` twice: each rank builds the model on the meta
  device, shards it, and reads only its shards' rows from the safetensors files.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from services.trainer.model import Qwen3MoE


class PeakResident:
    """The largest resident set of this process while the block runs, above what it was
    when the block began (MiB), sampled every millisecond from ``/proc/self/statm``."""

    def __enter__(self) -> PeakResident:
        self.start = self.peak = _resident_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _resident_mib())

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _resident_mib())

    @property
    def added_mib(self) -> float:
        """Peak minus start."""
        return self.peak - self.start


def _resident_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _load_whole(model_dir: Path) -> Qwen3MoE:
    """``load_pretrained`` as it was: the whole file, a float32 state dict, a whole model."""
    from services.trainer.model import Architecture, Qwen3MoE, from_hf
    from services.trainer.model.hf_io import read_safetensors

    arch = Architecture.from_model_dir(model_dir)
    with torch.device("meta"):
        model = Qwen3MoE(arch, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.load_state_dict(from_hf(read_safetensors(model_dir), arch))
    return model


def _worker(
    rank: int, world: int, port: int, model_dir: str, warm_up_dir: str, way: str, out: str
) -> None:
    from services.trainer.distributed.layout import ParallelLayout
    from services.trainer.distributed.runtime import ProcessInfo, start
    from services.trainer.model import Architecture

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    arch = Architecture.from_model_dir(Path(model_dir))
    layout = ParallelLayout.resolve(world, dp=world, cp=1, ep=world, num_experts=arch.num_experts)
    runtime = start(layout, backend="gloo", timeout_s=300, info=ProcessInfo(rank, rank, world))
    try:
        # The same load of a tiny model first: what the first load imports and sets up
        # (FSDP, DTensor, safetensors) is not the model's memory.
        _load(way, Path(warm_up_dir), runtime)
        gc.collect()
        with PeakResident() as resident:
            _load(way, Path(model_dir), runtime)
        Path(out, f"{way}-{rank}").write_text(str(resident.added_mib))
    finally:
        runtime.close()


def _load(way: str, model_dir: Path, runtime: Any) -> None:
    from services.trainer.distributed.parallelize import parallelize

    if way == "whole":
        policy = _load_whole(model_dir)
        reference = copy.deepcopy(policy).requires_grad_(False)
        parallelize(reference, runtime.meshes, runtime.device)
        parallelize(policy, runtime.meshes, runtime.device)
    else:
        options = {"dtype": torch.bfloat16}
        runtime.load_model(model_dir, seed=0, **options)
        runtime.load_model(model_dir, seed=0, **options).requires_grad_(False)


def main(preset: Literal["tiny", "small"] = "small", world: int = 2) -> dict[str, object]:
    """Both ways on a fresh ``preset`` model; the figures as a dict."""
    from services.model_factory.build import init_model
    from services.trainer.model import Architecture
    from services.wire.ports import free_port

    with tempfile.TemporaryDirectory(prefix="etude-load-memory-") as scratch:
        model_dir = Path(scratch) / preset
        init_model(preset, model_dir, seed=0)
        init_model("tiny", Path(scratch) / "warm-up", seed=0)
        arch = Architecture.from_model_dir(model_dir)
        figures: dict[str, object] = {"preset": preset, "world": world}
        for way in ("whole", "sharded"):
            args = (
                world,
                free_port(),
                str(model_dir),
                str(Path(scratch) / "warm-up"),
                way,
                scratch,
            )
            mp.spawn(_worker, args=args, nprocs=world, join=True)
            peaks = [float(Path(scratch, f"{way}-{rank}").read_text()) for rank in range(world)]
            figures[f"peak_mib_{way}"] = [round(peak, 1) for peak in peaks]
        from services.trainer.model import Qwen3MoE

        with torch.device("meta"):
            model = Qwen3MoE(arch)
        figures["model_float32_mib"] = round(
            sum(p.numel() for p in model.parameters()) * 4 / 2**20, 1
        )
    return figures


if __name__ == "__main__":
    chosen = sys.argv[1] if len(sys.argv) > 1 else "small"
    if chosen not in ("tiny", "small"):
        raise SystemExit(f"preset must be tiny or small, got {chosen!r}")
    print(json.dumps(main(chosen, int(sys.argv[2]) if len(sys.argv) > 2 else 2)))  # type: ignore[arg-type]
