"""Reading an HF checkpoint a tensor or a slice at a time: the same float32 tensors the
whole-file read gives, from the per-expert and the fused layout, and the rows asked for."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.trainer.model import Architecture, from_hf, load_pretrained
from services.trainer.model.checkpoint_reader import CheckpointReader
from services.trainer.model.hf_io import read_safetensors


def _fused_copy(model_dir: Path, out: Path, arch: Architecture) -> Path:
    """``model_dir`` with its experts stored fused (``gate_up_proj``, ``down_proj``)."""
    shutil.copytree(model_dir, out)
    tensors = read_safetensors(model_dir)
    state = from_hf(tensors, arch)
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        fused[f"{prefix}.gate_up_proj"] = state[f"{prefix}.gate_up"].bfloat16()
        fused[f"{prefix}.down_proj"] = state[f"{prefix}.down"].bfloat16()
    save_file(fused, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_reads_equal_the_whole_file_read(tiny_model: Path, tmp_path: Path, layout: str) -> None:
    arch = Architecture.from_model_dir(tiny_model)
    model_dir = (
        tiny_model if layout == "per_expert" else _fused_copy(tiny_model, tmp_path / "f", arch)
    )
    whole = from_hf(read_safetensors(model_dir), arch)
    with CheckpointReader(model_dir, arch) as reader:
        assert reader.names() == set(whole)
        for name, tensor in whole.items():
            assert reader.shape(name) == tuple(tensor.shape), name
            read = reader.read(name)
            assert read.dtype == torch.float32 and torch.equal(read, tensor), name
            rows = (1, tensor.shape[0]) if tensor.shape[0] > 1 else (0, 1)
            assert torch.equal(reader.read(name, rows), tensor[rows[0] : rows[1]]), name
    loaded = load_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in whole.items())


def test_a_checkpoint_of_another_shape_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    arch = Architecture.from_model_dir(tiny_model)
    model_dir = tmp_path / "extra"
    shutil.copytree(tiny_model, model_dir)
    tensors = read_safetensors(tiny_model)
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    tensors["model.norm.weight"] = torch.zeros(arch.hidden_size + 1, dtype=torch.bfloat16)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unknown tensors"):
        load_pretrained(model_dir)
    del tensors["model.layers.0.extra.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight: checkpoint shape"):
        load_pretrained(model_dir)
