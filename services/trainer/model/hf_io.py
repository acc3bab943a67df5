"""Loading and saving the trainer's model in the HF safetensors layout vLLM serves.

The state dict of ``Qwen3MoE`` has the HF names except for the experts: one fused
``mlp.experts.gate_up [E, 2F, D]`` (gate rows first, as transformers fuses them) and
``mlp.experts.down [E, D, F]`` per layer, where the checkpoint has
``mlp.experts.<e>.{gate,up,down}_proj.weight``. ``to_hf`` and ``from_hf`` translate;
both layouts of transformers' checkpoints (per-expert, or fused ``gate_up_proj``) load.
What the trainer publishes and saves is ``to_hf`` in bf16: exactly the weights
inference serves.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from services.draft_layout import published_draft
from services.trainer.model.architecture import Architecture
from services.trainer.model.checkpoint_reader import CheckpointReader, Rows, checkpoint_files
from services.trainer.model.layers import Numerics
from services.trainer.model.mtp import MTPHead
from services.trainer.model.transformer import Qwen3MoE
from services.trainer.precision import PrecisionConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "mtp.safetensors")
MTP_FILE = "mtp.safetensors"
MODEL_CARD = "etude_model.json"


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) HF safetensors checkpoint."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        tensors.update(load_file(path))
    return tensors


def from_hf(tensors: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> the trainer's state dict (float32)."""
    remaining = dict(tensors)
    state: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.gate_up_proj" in remaining:
            state[f"{prefix}.gate_up"] = remaining.pop(f"{prefix}.gate_up_proj")
            state[f"{prefix}.down"] = remaining.pop(f"{prefix}.down_proj")
            continue
        try:
            gate_up, down = [], []
            for expert in range(arch.num_experts):
                key = f"{prefix}.{expert}"
                gate_up.append(
                    torch.cat(
                        [
                            remaining.pop(f"{key}.gate_proj.weight"),
                            remaining.pop(f"{key}.up_proj.weight"),
                        ]
                    )
                )
                down.append(remaining.pop(f"{key}.down_proj.weight"))
        except KeyError as error:
            raise ValueError(f"checkpoint lacks expert weight {error.args[0]}") from None
        state[f"{prefix}.gate_up"] = torch.stack(gate_up)
        state[f"{prefix}.down"] = torch.stack(down)
    state.update(remaining)
    return {name: tensor.float() for name, tensor in state.items()}


def to_hf(
    model: Qwen3MoE, dtype: torch.dtype = torch.bfloat16, *, draft: bool = False
) -> dict[str, torch.Tensor]:
    """The model's weights under HF names, per-expert, cast to ``dtype`` (detached copies);
    with `draft`, its first MTP head as the served draft too (``state_to_hf``)."""
    return state_to_hf(model.state_dict(), model.arch, dtype, draft=draft)


def state_to_hf(
    state: dict[str, torch.Tensor],
    arch: Architecture,
    dtype: torch.dtype = torch.bfloat16,
    *,
    first_expert: int = 0,
    draft: bool = False,
) -> dict[str, torch.Tensor]:
    """Trainer state-dict tensors -> HF names, per-expert, in ``dtype`` (detached copies).

    ``state`` may hold any subset of the model's tensors, and its fused expert tensors may
    hold a slice of the experts (``[E', ...]``) whose first is global expert
    ``first_expert``: what one expert-parallel rank holds and publishes. MTP tensors are
    not part of the served model (they are saved beside it); with `draft`, the first
    head's go in under the names of inference's speculative draft
    (``services.draft_layout.published_draft``), as every published version carries them.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, param in state.items():
        if name.startswith("mtp."):
            if draft:
                for part, tensor in published_draft(name, param.detach()).items():
                    tensors[part] = tensor.to(dtype).clone()
            continue
        if name.endswith(".mlp.experts.gate_up"):
            prefix = name.removesuffix(".gate_up")
            gate, up = param.detach().split(arch.moe_intermediate_size, dim=1)
            for index in range(gate.shape[0]):
                key = f"{prefix}.{first_expert + index}"
                tensors[f"{key}.gate_proj.weight"] = gate[index].to(dtype).clone()
                tensors[f"{key}.up_proj.weight"] = up[index].to(dtype).clone()
        elif name.endswith(".mlp.experts.down"):
            prefix = name.removesuffix(".down")
            for index in range(param.shape[0]):
                key = f"{prefix}.{first_expert + index}.down_proj.weight"
                tensors[key] = param[index].detach().to(dtype).clone()
        else:
            tensors[name] = param.detach().to(dtype).clone()
    return tensors


def _read_mtp(model_dir: Path) -> dict[str, torch.Tensor]:
    path = model_dir / MTP_FILE
    return dict(load_file(path)) if path.is_file() else {}


def load_pretrained(
    model_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    experts_precision: PrecisionConfig | None = None,
    replay_min_prob_ratio: float = 0.1,
    num_mtp_heads: int = 0,
    seed: int = 0,
    numerics: Numerics = "eager",
) -> Qwen3MoE:
    """A ``Qwen3MoE`` with the weights of an HF model directory (float32 master weights).

    MTP heads load from ``mtp.safetensors`` when it has them; missing ones start fresh
    from ``seed``.
    """
    arch = Architecture.from_model_dir(model_dir)
    # Built on the meta device: random initialization of large expert tensors is wasted work.
    with torch.device("meta"):
        model = Qwen3MoE(
            arch,
            dtype=dtype,
            experts_precision=experts_precision,
            replay_min_prob_ratio=replay_min_prob_ratio,
            num_mtp_heads=num_mtp_heads,
            numerics=numerics,
        )
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    for head in model.mtp:
        assert isinstance(head, MTPHead)
        head.reset_parameters(generator)
    with CheckpointReader(model_dir, arch) as reader:
        load_weights(model, reader, _read_mtp(Path(model_dir)))
    return model


def load_weights(
    model: Qwen3MoE,
    reader: CheckpointReader,
    saved_mtp: dict[str, torch.Tensor],
    rows: Callable[[str], Rows | None] = lambda name: None,
) -> None:
    """Copies the checkpoint into ``model``'s tensors, one tensor (or the ``rows`` of it
    that ``rows(name)`` names, for a shard) at a time, float32.

    MTP heads present in ``saved_mtp`` load; the rest keep the weights they have, and heads
    the file has beyond the model's are left out.
    """
    state = model.state_dict()  # tensors that share the parameters' storage
    expected = {name for name in state if not name.startswith("mtp.")}
    found = reader.names()
    unknown, missing = sorted(found - expected), sorted(expected - found)
    if unknown or missing:
        raise ValueError(
            f"checkpoint {reader.model_dir} does not match the architecture: unknown tensors "
            f"{unknown[:5]}, missing tensors {missing[:5]}"
        )
    shapes = {name: reader.shape(name) for name in expected}
    shapes |= {name: tuple(saved_mtp[name].shape) for name in state if name in saved_mtp}
    for name, shape in sorted(shapes.items()):
        if shape != tuple(state[name].shape):  # a DTensor's shape is the whole tensor's
            raise ValueError(
                f"{name}: checkpoint shape {shape} != model shape {tuple(state[name].shape)}"
            )
    with torch.no_grad():
        for name, target in state.items():
            local = target.to_local() if isinstance(target, DTensor) else target
            if name.startswith("mtp."):
                if name in saved_mtp:
                    whole = saved_mtp[name].float()
                    span = rows(name)
                    local.copy_(whole if span is None else whole[span[0] : span[1]])
                continue
            local.copy_(reader.read(name, rows(name)))


def save_pretrained(
    model: Qwen3MoE, out: Path, *, source_dir: Path, policy_version: int | None = None
) -> Path:
    """Writes ``out`` as an HF model directory: ``source_dir``'s config and tokenizer files,
    the model's bf16 weights, and (when set) ``policy_version`` in the model card.

    The directory appears complete or not at all (written aside, then renamed).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as staging_dir:
        staging = Path(staging_dir)
        for item in Path(source_dir).iterdir():
            if item.is_file() and item.name not in WEIGHT_FILES:
                shutil.copy2(item, staging / item.name)
        save_file(to_hf(model), staging / "model.safetensors", metadata={"format": "pt"})
        mtp = {n: t.detach().clone() for n, t in model.state_dict().items() if n.startswith("mtp.")}
        if mtp:
            save_file(mtp, staging / MTP_FILE, metadata={"format": "pt"})
        card_path = staging / MODEL_CARD
        if policy_version is not None and card_path.is_file():
            card = json.loads(card_path.read_text())
            card["policy_version"] = policy_version
            card_path.write_text(json.dumps(card, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.chmod(0o755)
        staging.rename(out)
    return out
