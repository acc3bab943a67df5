"""Dense building blocks of Qwen3-MoE on a packed token stream: RMSNorm, RoPE, attention.

Tokens of several sequences travel as one flat stream ``[T, ...]`` with ``cu_seqlens``
(the cumulative sequence boundaries, ``[0, len0, len0 + len1, ...]``) and per-token
``position_ids`` that restart at 0 for each sequence, as varlen attention kernels take
them. Parameters are float32 master weights, cast to the compute dtype of the
activations at each use (what FSDP2's mixed precision does).

Two orders of rounding (``Numerics``): ``"eager"`` follows the order and dtypes of
transformers' Qwen3-MoE, so bf16 results are bit-identical to it; ``"fused"`` rounds
where an inference engine's fused kernels do (vLLM's CPU kernels, measured bit for bit
in docs/trainer.md): each fused operation computes in float32 and rounds its output
once, as the engine's kernels convert on this device (``precision.rounding``: truncation
on an AVX2 CPU).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from services.trainer.precision.rounding import kernel_round

Numerics = Literal["eager", "fused"]
"""Where bf16 activations round: after every operation as transformers' eager forward does
(``"eager"``), or once per fused kernel as inference engines do (``"fused"``)."""


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; the normalization in float32, the scale in the output dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [..., width]`` -> same shape, in ``dtype`` (default: ``x``'s).

        A float32 ``x`` with a bf16 ``dtype`` is a fused add-and-normalize: the sum of the
        residual and a branch, normalized before it is rounded.
        """
        dtype = dtype or x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * hidden.to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with the master weight cast to the activations' dtype."""
    return F.linear(x, weight.to(x.dtype))


def rope_tables(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[T, head_dim]``: computed in float32, then cast like HF does."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=position_ids.device) / head_dim)
    )
    freqs = position_ids.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, numerics: Numerics = "eager"
) -> torch.Tensor:
    """Rotates ``x [T, heads, head_dim]`` by the tables of its tokens.

    ``"fused"`` computes the rotation in float32 from the same (compute-dtype) tables and
    rounds once, as a fused RoPE kernel does; ``"eager"`` rounds each product and the sum.
    """
    if numerics == "fused":
        wide = x.float()
        rotated = wide * cos[:, None, :].float() + _rotate_half(wide) * sin[:, None, :].float()
        return kernel_round(rotated, x.dtype)
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


AttentionCore = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int], Sequence[Sequence[int]] | None],
    torch.Tensor,
]
"""``(query [T, H, D], key [T, Hkv, D], value [T, Hkv, D], cu_seqlens, ancestors) -> [T, H, D]``;
``ancestors`` is None for independent sequences, or per run of a prefix tree the runs
above it (``services.trainer.model.prefix_tree``)."""


def _run_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num_prefix_keys: int,
) -> torch.Tensor:
    """``query [L, H, D]`` over ``key``/``value [P + L, Hkv, D]``: all ``P`` prefix keys, then
    causally the run's own ``L``."""
    length = query.shape[0]
    mask = None
    if num_prefix_keys:
        mask = torch.ones(
            length, num_prefix_keys + length, dtype=torch.bool, device=query.device
        ).tril(num_prefix_keys)
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)


def varlen_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``causal_attention`` runs as one varlen (flash) call: CUDA with bf16/fp16
    activations. On CPU there is no flash kernel, FlexAttention has no CPU backward, and
    one SDPA over the pack with a block-diagonal mask was 4-15x slower than an SDPA per
    sequence (docs/trainer.md), so the CPU keeps one SDPA per sequence."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def _varlen_attention(
    queries: Sequence[torch.Tensor],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    ancestors: Sequence[Sequence[int]] | None,
) -> torch.Tensor:
    """All runs in one ``varlen_attn`` call. A run of a prefix tree gets its ancestors' keys
    before its own; the flash kernel's causal mask is aligned to the bottom right when a
    run has more keys than queries, so it sees every prefix key, then causally its own."""
    from torch.nn.attention.varlen import varlen_attn

    runs_keys: list[torch.Tensor] = []
    runs_values: list[torch.Tensor] = []
    key_lengths: list[int] = []
    for run, (k, v) in enumerate(zip(keys, values, strict=True)):
        above = ancestors[run] if ancestors is not None else ()
        runs_keys += [*(keys[a] for a in above), k]
        runs_values += [*(values[a] for a in above), v]
        key_lengths.append(sum(keys[a].shape[0] for a in above) + k.shape[0])
    query_lengths = [q.shape[0] for q in queries]
    device = queries[0].device

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    attended = varlen_attn(
        torch.cat(list(queries)),
        torch.cat(runs_keys),
        torch.cat(runs_values),
        cumulative(query_lengths),
        cumulative(key_lengths),
        max(query_lengths),
        max(key_lengths),
        window_size=(-1, 0),
        enable_gqa=True,
    )
    assert isinstance(attended, torch.Tensor)
    return attended


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: Sequence[int],
    ancestors: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Causal GQA attention within each packed sequence; no token sees another sequence.

    With ``ancestors`` the spans of ``cu_seqlens`` are the runs of a prefix tree: a run
    attends to every key of the runs above it, then causally to its own. On CUDA in
    bf16/fp16 this is one varlen flash-attention call; elsewhere one SDPA per sequence.
    """
    lengths = [end - start for start, end in itertools.pairwise(cu_seqlens)]
    # ``split``, not a slice per sequence: a slice's backward writes its gradient into a
    # zeroed tensor of the whole stream, which made the backward quadratic in the number
    # of sequences (40% of an SFT step of the small model); a split's backward is one
    # concatenation (and a run's keys gathered with ``cat`` likewise send their gradients
    # back without a fill).
    queries, keys, values = query.split(lengths), key.split(lengths), value.split(lengths)
    if varlen_runs(query.device, query.dtype):
        return _varlen_attention(queries, keys, values, ancestors)
    outputs = []
    for run, (q, k, v) in enumerate(zip(queries, keys, values, strict=True)):
        above = ancestors[run] if ancestors is not None else ()
        if above:
            k = torch.cat([*(keys[a] for a in above), k])
            v = torch.cat([*(values[a] for a in above), v])
        outputs.append(_run_attention(q, k, v, k.shape[0] - q.shape[0]))
    return torch.cat(outputs)


class Attention(nn.Module):
    """Causal GQA self-attention with per-head q/k RMSNorm, within each packed sequence.

    ``core`` computes the attention itself from the rotated queries and keys; context
    parallelism swaps in one that attends over the whole sequence held by several ranks
    (``services.trainer.distributed.context_parallel``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        numerics: Numerics = "eager",
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.numerics = numerics
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.core: AttentionCore = causal_attention

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: Sequence[int],
        ancestors: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; no token attends across a sequence boundary
        (with ``ancestors``, a run of a prefix tree attends to the runs above it too)."""
        num_tokens = x.shape[0]
        query = self.q_norm(linear(x, self.q_proj.weight).view(num_tokens, -1, self.head_dim))
        key = self.k_norm(linear(x, self.k_proj.weight).view(num_tokens, -1, self.head_dim))
        value = linear(x, self.v_proj.weight).view(num_tokens, -1, self.head_dim)
        cos, sin = rope
        query = apply_rope(query, cos, sin, self.numerics)
        key = apply_rope(key, cos, sin, self.numerics)
        if self.numerics == "fused":
            # A fused attention kernel keeps the scores, the probabilities and the output
            # accumulator in float32 and rounds the output once.
            attended = self.core(query.float(), key.float(), value.float(), cu_seqlens, ancestors)
            attended = kernel_round(attended, query.dtype)
        else:
            attended = self.core(query, key, value, cu_seqlens, ancestors)
        return linear(
            attended.reshape(num_tokens, self.num_heads * self.head_dim), self.o_proj.weight
        )
