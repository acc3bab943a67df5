"""Optimizers: AdamW, or Muon for the hidden matrices (experts included) and AdamW for
the rest.

Muon orthogonalizes the update of a weight matrix, which is meaningful for the hidden
matrices: attention projections and every expert's matrices (a 3-D expert tensor is a
stack of them, ``services.trainer.muon.MatrixMuon``); embeddings, the output head,
norms, the router and the MTP heads stay on AdamW (the router and the vocabulary
matrices are conventionally left to AdamW). Muon runs on sharded weights too: each
matrix is orthogonalized whole (``MatrixMuon``). The learning rate follows a linear
warm-up, computed from the step number, so it needs no state of its own in checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from services.config.trainer import OptimizerConfig
from services.trainer.muon import MatrixMuon

_ADAMW_ONLY_2D = ("embed_tokens", "lm_head", ".gate.", "mtp.")


def muon_parameter(name: str, param: nn.Parameter) -> bool:
    """Whether Muon (not AdamW) updates this parameter: a hidden matrix or a stack of
    expert matrices."""
    return param.dim() in (2, 3) and not any(part in f".{name}" for part in _ADAMW_ONLY_2D)


def build_optimizers(model: nn.Module, config: OptimizerConfig) -> list[torch.optim.Optimizer]:
    """The optimizers of ``model``'s trainable parameters (one, or Muon then AdamW)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if config.name == "muon":
        matrices = [p for n, p in named if muon_parameter(n, p)]
        rest = [p for n, p in named if not muon_parameter(n, p)]
    else:
        matrices, rest = [], [p for _, p in named]
    optimizers: list[torch.optim.Optimizer] = []
    if matrices:
        optimizers.append(
            MatrixMuon(
                matrices,
                lr=config.muon_lr,
                weight_decay=config.weight_decay,
                momentum=config.muon_momentum,
            )
        )
    optimizers.append(
        torch.optim.AdamW(
            rest,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    )
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["base_lr"] = group["lr"]
    return optimizers


def set_learning_rate(
    optimizers: list[torch.optim.Optimizer], config: OptimizerConfig, step: int
) -> float:
    """Applies the warm-up for 0-based ``step``; returns the AdamW learning rate."""
    factor = min(1.0, (step + 1) / config.warmup_steps) if config.warmup_steps else 1.0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
    return float(optimizers[-1].param_groups[0]["lr"])


def clip_and_step(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], max_grad_norm: float
) -> float:
    """Clips the global gradient norm (when ``max_grad_norm`` > 0), steps; returns the norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(norm)
