"""Muon for matrices and stacks of matrices, whole or sharded (FSDP2 / expert parallel).

``torch.optim.Muon`` takes plain 2-D parameters only. The report's successor recipe runs
Muon on every hidden matrix, expert weights included, with the weights sharded. This
optimizer keeps ``torch.optim.Muon``'s update exactly (momentum, Nesterov, its
Newton-Schulz iteration ``_zeropower_via_newtonschulz``, its learning-rate adjustment,
decoupled weight decay) and adds two things:

* a 3-D parameter is a stack of matrices (``[num_experts, out, in]``): each matrix is
  orthogonalized on its own, and the learning rate is adjusted by the matrix's shape;
* a sharded parameter (a DTensor) is orthogonalized whole: the momentum update is
  gathered on every rank (``full_tensor``), every rank runs the same Newton-Schulz on the
  whole matrix, and keeps its own shard of the result (``distribute_tensor`` without a
  source rank only slices). Momentum buffers stay sharded like their parameters.

So a distributed step equals the single-process step up to the summation order of the
gradients it starts from. Gathering every matrix on every rank costs one all-gather per
parameter and redundant Newton-Schulz work; at the sizes this trainer runs that is small
next to the step. A distributed Newton-Schulz (each rank orthogonalizing its share of
the matrices) is the next step for large models.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

# torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def orthogonalize(
    update: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """Newton-Schulz of a matrix, or of each matrix of a stack (the leading dimension)."""
    if update.dim() == 2:
        return _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    return torch.stack(
        [_zeropower_via_newtonschulz(matrix, ns_coefficients, ns_steps, eps) for matrix in update]
    )


class MatrixMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update for 2-D and 3-D parameters, plain or DTensor."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"lr ({lr}), momentum ({momentum}) and weight_decay ({weight_decay}) must be >= 0"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() not in (2, 3):
                    raise ValueError(
                        f"Muon updates matrices (2-D) and stacks of them (3-D); got a "
                        f"parameter of shape {tuple(param.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One update of every parameter with a gradient."""
        assert closure is None, "MatrixMuon takes no closure"
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                whole = update.full_tensor() if isinstance(update, DTensor) else update
                orthogonal = orthogonalize(whole, NS_COEFFICIENTS, NS_STEPS, EPS)
                if isinstance(update, DTensor):
                    orthogonal = distribute_tensor(
                        orthogonal, update.device_mesh, update.placements, src_data_rank=None
                    )
                adjusted_lr = _adjust_lr(lr, None, param.shape[-2:])
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(orthogonal, alpha=-adjusted_lr)
