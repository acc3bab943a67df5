"""Reading an HF safetensors checkpoint a tensor (or a slice of one) at a time.

``CheckpointReader`` serves the trainer's state-dict names (fused experts
``mlp.experts.gate_up [E, 2F, D]`` and ``mlp.experts.down [E, D, F]``) from either HF
layout, per-expert or fused, through ``safetensors.safe_open``: a read maps the rows asked
for and converts only them to float32. So a process never holds the whole checkpoint, nor a
float32 copy of it, beside its model: loading peaks at the model plus its largest tensor, and
a rank of a sharded job reads only the rows of its own shards (``rows``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from services.trainer.model.architecture import Architecture

Rows = tuple[int, int]
"""``(start, end)`` of the first dimension (experts for the expert tensors)."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a (possibly sharded) HF checkpoint."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    raise FileNotFoundError(f"{model_dir} holds no model.safetensors (or its index)")


class CheckpointReader:
    """The trainer's tensors of an HF checkpoint, read lazily (use as a context manager)."""

    def __init__(self, model_dir: Path, arch: Architecture) -> None:
        self.model_dir, self.arch = Path(model_dir), arch
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}  # HF name -> the open file that holds it
        for path in checkpoint_files(model_dir):
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._handles.update(dict.fromkeys(handle.keys(), handle))
        self._fused: set[str] = set()  # expert prefixes stored fused (gate_up_proj)
        self._per_expert: set[str] = set()
        for layer in range(arch.num_layers):
            prefix = f"model.layers.{layer}.mlp.experts"
            if f"{prefix}.gate_up_proj" in self._handles:
                self._fused.add(prefix)
            elif any(name.startswith(f"{prefix}.") for name in self._handles):
                self._per_expert.add(prefix)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        """The trainer's names of every tensor the checkpoint holds."""
        names = set()
        for name in self._handles:
            prefix, _, rest = name.partition(".mlp.experts.")
            if not rest:
                names.add(name)
            elif rest in ("gate_up_proj", "down_proj"):
                names.add(f"{prefix}.mlp.experts.{rest.removesuffix('_proj')}")
            else:
                names.update((f"{prefix}.mlp.experts.gate_up", f"{prefix}.mlp.experts.down"))
        return names

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape under the trainer's name."""
        prefix, _, part = name.rpartition(".")
        if prefix in self._per_expert:
            e, f, d = self.arch.num_experts, self.arch.moe_intermediate_size, self.arch.hidden_size
            return (e, 2 * f, d) if part == "gate_up" else (e, d, f)
        hf_name = f"{name}_proj" if prefix in self._fused else name
        return tuple(self._handles[hf_name].get_slice(hf_name).get_shape())

    def read(self, name: str, rows: Rows | None = None) -> torch.Tensor:
        """Tensor ``name`` (trainer name), or its ``rows`` of the first dimension, float32."""
        prefix, _, part = name.rpartition(".")
        if prefix in self._per_expert:
            return self._read_experts(prefix, part, rows or (0, self.arch.num_experts))
        hf_name = f"{name}_proj" if prefix in self._fused else name
        if hf_name not in self._handles:
            raise KeyError(f"the checkpoint holds no {hf_name}")
        sliced = self._handles[hf_name].get_slice(hf_name)
        tensor = sliced[:] if rows is None else sliced[rows[0] : rows[1]]
        return tensor.float()

    def _read_experts(self, prefix: str, part: str, rows: Rows) -> torch.Tensor:
        """Experts ``rows`` of the per-expert HF names, fused as the trainer holds them."""
        pieces = []
        try:
            for expert in range(*rows):
                key = f"{prefix}.{expert}"
                if part == "gate_up":
                    pieces.append(
                        torch.cat(
                            [
                                self._get(f"{key}.gate_proj.weight"),
                                self._get(f"{key}.up_proj.weight"),
                            ]
                        )
                    )
                else:
                    pieces.append(self._get(f"{key}.down_proj.weight"))
        except KeyError as error:
            raise ValueError(f"checkpoint lacks expert weight {error.args[0]}") from None
        return torch.stack(pieces).float()

    def _get(self, hf_name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._handles[hf_name].get_tensor(hf_name)
        return tensor
