"""Expert parallelism: each rank holds ``num_experts / ep`` experts; tokens travel to them.

``ExpertParallelExperts`` replaces a layer's ``MoEExperts`` and keeps its interface: it
takes the layer's tokens sorted by (global) expert with the per-expert counts, and
returns the experts' outputs in the same order. In between:

1. **counts**: an all-to-all of the ``[num_experts]`` counts tells every rank how many
   tokens each peer sends to each of its local experts;
2. **dispatch**: an all-to-all of the token activations to the ranks holding their
   experts. With the ``nvfp4_fwd_mxfp8_bwd`` recipe the payload is MXFP8 (E4M3 codes
   and E8M0 scales per 32 elements, as bytes) and is dequantized on arrival, as the
   report does; the gradient goes back in the activations' dtype (straight through
   the quantization);
3. the local experts run as one grouped GEMM over the arrivals re-sorted by local
   expert (stable, so each expert sees its tokens in (source rank, stream) order);
4. **combine**: the outputs go back by the reverse all-to-all, in the activations' dtype
   (bf16 in training; float32 in the float32 reference runs).

Routing, router replay and the plausibility filter run before the dispatch, on the
rank that holds the token, so they are unchanged. The expert weights are a DTensor
sharded on dim 0 over the ``ep`` mesh axis (``[E, ...]`` globally), so checkpoints and
published weights see whole tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from services.trainer.precision import MoEExperts
from services.trainer.precision.moe import swiglu_experts
from services.trainer.precision.mxfp8 import quantize_mxfp8


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with row splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


class _MXFP8Dispatch(torch.autograd.Function):
    """The dispatch with an MXFP8 payload; the gradient returns unquantized."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        quantized = quantize_mxfp8(x)
        codes = _exchange(quantized.data.view(torch.uint8), send_splits, recv_splits, group)
        scales = _exchange(quantized.scale.view(torch.uint8), send_splits, recv_splits, group)
        arrived = type(quantized)(
            codes.view(quantized.data.dtype), scales.view(quantized.scale.dtype)
        )
        return arrived.dequantize(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def _exchange(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all(
    x: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup,
    *,
    mxfp8: bool = False,
) -> torch.Tensor:
    """Rows ``x[sum(send[:r]) : sum(send[:r+1])]`` go to rank r of ``group``; differentiable."""
    function = _MXFP8Dispatch if mxfp8 else _AllToAll
    out: torch.Tensor = function.apply(x, send_splits, recv_splits, group)
    return out


class ExpertParallelExperts(MoEExperts):
    """The experts of one layer, ``num_experts / ep`` of them on this rank (module doc).

    ``num_experts`` stays the global count (the router's); ``gate_up`` and ``down`` are
    DTensors ``[num_experts, ...]`` sharded on dim 0 over ``mesh``.
    """

    def __init__(self, experts: MoEExperts, mesh: DeviceMesh) -> None:
        nn.Module.__init__(self)
        size, index = mesh.size(), mesh.get_local_rank()
        if experts.num_experts % size:
            raise ValueError(
                f"num_experts ({experts.num_experts}) must be divisible by the ep degree ({size})"
            )
        self.config = experts.config
        self.num_experts, self.d_model, self.d_ff = (
            experts.num_experts,
            experts.d_model,
            experts.d_ff,
        )
        self.num_local_experts = experts.num_experts // size
        self.first_local_expert = index * self.num_local_experts
        self.mesh, self.group = mesh, mesh.get_group()
        self.mxfp8_dispatch = experts.config.precision == "nvfp4_fwd_mxfp8_bwd"
        local = slice(self.first_local_expert, self.first_local_expert + self.num_local_experts)
        for name in ("gate_up", "down"):
            full: nn.Parameter = getattr(experts, name)
            shard = DTensor.from_local(
                full.detach()[local].clone(), mesh, [Shard(0)], run_check=False
            )
            setattr(self, name, nn.Parameter(shard, requires_grad=full.requires_grad))

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = self.gate_up, self.down
        return (
            gate_up.to_local() if isinstance(gate_up, DTensor) else gate_up,
            down.to_local() if isinstance(down, DTensor) else down,
        )

    def forward(
        self,
        tokens_sorted: torch.Tensor,
        group_sizes: torch.Tensor | list[int],
        *,
        fused: bool = False,
    ) -> torch.Tensor:
        """``tokens_sorted [T, d_model]`` grouped by global expert (``group_sizes [E]``).

        ``fused``: see ``services.trainer.precision.moe.swiglu_experts``.
        """
        ep, num_local = self.mesh.size(), self.num_local_experts
        sizes = torch.as_tensor(group_sizes, dtype=torch.long, device=tokens_sorted.device)
        arriving = torch.empty_like(sizes)
        dist.all_to_all_single(arriving, sizes, group=self.group)
        counts = arriving.view(ep, num_local)  # [source rank, local expert]
        send_splits = sizes.view(ep, num_local).sum(dim=1).tolist()
        recv_splits = counts.sum(dim=1).tolist()
        arrived = all_to_all(
            tokens_sorted, send_splits, recv_splits, self.group, mxfp8=self.mxfp8_dispatch
        )
        expert_of_row = torch.arange(num_local, device=sizes.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(counts.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        gate_up, down = self._local_weights()
        out = swiglu_experts(
            arrived[order], gate_up, down, counts.sum(dim=0), self.config, fused=fused
        )
        returned = out[torch.argsort(order)]  # back to arrival order
        return all_to_all(returned, recv_splits, send_splits, self.group)
