"""Context parallelism: each sequence split over the ranks of a cp group, load-balanced.

A sequence of ``L`` tokens is cut into ``2 * cp`` chunks of ``m = L / (2 cp)`` tokens;
rank ``i`` of the group holds chunks ``i`` and ``2 cp - 1 - i``. Under a causal mask the
queries of chunk ``c`` see ``c * m + (1..m)`` keys, so rank ``i`` does
``(2 cp - 1) m**2 + m (m + 1)`` query-key pairs whatever ``i`` is: the early, cheap chunk
and the late, expensive one pair up (``rank_attention_pairs`` counts it; the tests check
every length). Packed streams stay packed: every sequence of a microbatch is split this
way and a rank's stream is its two chunks of each sequence in turn, with global
``position_ids`` (RoPE needs the true positions) and local ``cu_seqlens``.

Attention: each rank all-gathers the keys and values of the group (``all_gather_single``;
the backward is a reduce-scatter of their gradients) and lets each local chunk attend to
the keys of its own sequence up to its own position, with the exact causal mask across
chunks; no token sees another sequence. Everything else in the model is per token, so it
runs on the local chunks unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.trainer.batch import Microbatch
from services.trainer.model.transformer import PackedInputs


def held_chunks(cp_index: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) that position ``cp_index`` of a cp group holds."""
    if not 0 <= cp_index < cp:
        raise ValueError(f"cp_index must be in [0, {cp}), got {cp_index}")
    return cp_index, 2 * cp - 1 - cp_index


def check_divisible(lengths: Sequence[int], cp: int) -> None:
    """``ValueError`` unless every length splits into ``2 * cp`` equal chunks."""
    bad = [length for length in lengths if length % (2 * cp)]
    if bad:
        raise ValueError(
            f"context parallelism with cp = {cp} cuts each sequence into {2 * cp} equal chunks: "
            f"sequence lengths must be multiples of {2 * cp}, got {bad[:5]} "
            f"(the distributed batch pads sequences to a multiple; see docs/distributed.md)"
        )


def local_token_index(cu_seqlens: Sequence[int], cp_index: int, cp: int) -> torch.Tensor:
    """Indices into a packed stream of the tokens rank ``cp_index`` holds, in local order."""
    lengths = [end - start for start, end in itertools.pairwise(cu_seqlens)]
    check_divisible(lengths, cp)
    parts = []
    for start, length in zip(cu_seqlens[:-1], lengths, strict=True):
        chunk = length // (2 * cp)
        for index in held_chunks(cp_index, cp):
            parts.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    return torch.cat(parts)


def rank_attention_pairs(length: int, cp: int) -> list[int]:
    """Causal query-key pairs each cp rank computes for one sequence of ``length`` tokens.

    Counted from the positions ``local_token_index`` gives each rank (query at position
    ``p`` sees ``p + 1`` keys): the attention FLOPs of a rank are this times
    ``4 * heads * head_dim``.
    """
    pairs = []
    for cp_index in range(cp):
        positions = local_token_index([0, length], cp_index, cp)
        pairs.append(int((positions + 1).sum()))
    return pairs


def shard_inputs(inputs: PackedInputs, cp_index: int, cp: int) -> PackedInputs:
    """The part of a packed stream rank ``cp_index`` of a cp group runs."""
    if inputs.shares_prefixes:
        raise ValueError(
            f"context parallelism (cp = {cp}) cuts whole sequences, not a prefix-shared stream"
        )
    index = local_token_index(inputs.cu_seqlens, cp_index, cp)
    cu_local = [start // cp for start in inputs.cu_seqlens]
    return PackedInputs(
        input_ids=inputs.input_ids[index],
        position_ids=inputs.position_ids[index],
        cu_seqlens=cu_local,
        replay_experts=None if inputs.replay_experts is None else inputs.replay_experts[index],
        replay_mask=None if inputs.replay_mask is None else inputs.replay_mask[index],
    )


def shard_microbatch(microbatch: Microbatch, cp_index: int, cp: int) -> Microbatch:
    """The part of ``microbatch`` rank ``cp_index`` trains on (every per-token field sliced)."""
    if cp == 1:
        return microbatch
    index = local_token_index(microbatch.inputs.cu_seqlens, cp_index, cp)
    padding = microbatch.padding[index] if microbatch.padding is not None else None
    return replace(
        microbatch,
        inputs=shard_inputs(microbatch.inputs, cp_index, cp),
        targets=microbatch.targets[index],
        trained=microbatch.trained[index],
        behaviour_logprobs=microbatch.behaviour_logprobs[index],
        advantages=microbatch.advantages[index],
        weights=microbatch.weights[index],
        generating_versions=microbatch.generating_versions[index],
        padding=padding,
    )


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along dim 0 over a group; the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        # Summed, not averaged: every rank's queries contribute to every key's gradient.
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None, None


def gather_from_group(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``[size * T, ...]``: ``x [T, ...]`` of every rank of ``group`` in rank order."""
    out: torch.Tensor = _GatherFromGroup.apply(x, group, size)
    return out


class ContextParallelAttention:
    """An ``Attention.core`` for rank ``cp_index`` of a cp group (see the module doc).

    Takes the local stream (two chunks of each sequence, local ``cu_seqlens``) and returns
    the attention output of the local queries over their whole sequences.
    """

    def __init__(self, group: dist.ProcessGroup, cp_index: int, cp: int) -> None:
        held_chunks(cp_index, cp)
        self.group, self.cp_index, self.cp = group, cp_index, cp

    def _sequence_index(self, start: int, chunk: int, num_local: int) -> torch.Tensor:
        """Rows of the gathered ``[cp * T_local]`` keys that form one whole sequence."""
        parts = []
        for index in range(2 * self.cp):
            owner = index if index < self.cp else 2 * self.cp - 1 - index
            offset = start + (0 if index < self.cp else chunk)
            row = owner * num_local + offset
            parts.append(torch.arange(row, row + chunk))
        return torch.cat(parts)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: Sequence[int],
        ancestors: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """``query [T, H, D]``, ``key``/``value [T, Hkv, D]`` (local) -> ``[T, H, D]``."""
        # ``shard_inputs`` refuses a prefix-shared stream, so none reaches this core.
        assert ancestors is None or not any(ancestors), "a prefix tree under context parallelism"
        num_local = query.shape[0]
        gathered = gather_from_group(torch.stack([key, value], dim=1), self.group, self.cp)
        outputs = []
        for start, end in itertools.pairwise(cu_seqlens):
            chunk = (end - start) // 2
            whole = gathered[self._sequence_index(start, chunk, num_local).to(query.device)]
            keys, values = whole[:, 0].transpose(0, 1)[None], whole[:, 1].transpose(0, 1)[None]
            for half, index in enumerate(held_chunks(self.cp_index, self.cp)):
                rows = slice(start + half * chunk, start + (half + 1) * chunk)
                visible = (index + 1) * chunk
                # Query i of chunk `index` sits at position index * chunk + i: it sees every
                # key up to there, the earlier chunks whole and its own causally.
                query_pos = torch.arange(chunk, device=query.device)[:, None] + index * chunk
                mask = torch.arange(visible, device=query.device)[None, :] <= query_pos
                attended = F.scaled_dot_product_attention(
                    query[rows].transpose(0, 1)[None],
                    keys[:, :, :visible],
                    values[:, :, :visible],
                    attn_mask=mask,
                    enable_gqa=True,
                )
                outputs.append(attended[0].transpose(0, 1))
        return torch.cat(outputs)
