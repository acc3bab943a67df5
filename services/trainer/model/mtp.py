"""Multi-token-prediction heads, trained by self-distillation (for speculative decoding).

Head ``d`` (1-based) predicts token ``t + 1 + d`` at position ``t`` from the previous
head's hidden state (the trunk's final hidden state for ``d = 1``) and the embedding of
token ``t + d``, as DeepSeek-V3's MTP modules do: both normalized, concatenated,
projected back to the model width, then one causal attention + SwiGLU block; the trunk's
``lm_head`` and embeddings are shared.

The target is not the data but the main head's own distribution for the same token
(its prediction at position ``t + d``), so the heads learn to draft what the policy
would sample. The trunk's hidden states enter detached: the MTP loss never changes
the policy. MTP weights are saved beside the HF weights (``mtp.safetensors``), not in
them, and are not published to inference.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.trainer.model.architecture import Architecture
from services.trainer.model.layers import Attention, RMSNorm, linear


class MTPHead(nn.Module):
    """One MTP module: (previous hidden, next-token embedding) -> hidden for one token further."""

    def __init__(self, arch: Architecture) -> None:
        super().__init__()
        width = arch.hidden_size
        self.hidden_norm = RMSNorm(width, arch.rms_norm_eps)
        self.embed_norm = RMSNorm(width, arch.rms_norm_eps)
        self.proj = nn.Linear(2 * width, width, bias=False)
        self.attn_norm = RMSNorm(width, arch.rms_norm_eps)
        self.attn = Attention(
            width,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
            arch.rms_norm_eps,
        )
        self.mlp_norm = RMSNorm(width, arch.rms_norm_eps)
        self.gate_up = nn.Linear(width, 2 * arch.moe_intermediate_size, bias=False)
        self.down = nn.Linear(arch.moe_intermediate_size, width, bias=False)
        self.final_norm = RMSNorm(width, arch.rms_norm_eps)

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Fresh weights (normal, std 0.02 as Qwen initializes; norms at 1)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(0.02 * torch.randn(param.shape, generator=generator))

    def forward(
        self,
        previous: torch.Tensor,
        next_embeddings: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: Sequence[int],
    ) -> torch.Tensor:
        """``previous [T, D]``, ``next_embeddings [T, D]`` -> normalized hidden ``[T, D]``."""
        joined = torch.cat([self.hidden_norm(previous), self.embed_norm(next_embeddings)], dim=-1)
        hidden = linear(joined, self.proj.weight)
        hidden = hidden + self.attn(self.attn_norm(hidden), rope, cu_seqlens)
        gate, up = linear(self.mlp_norm(hidden), self.gate_up.weight).chunk(2, dim=-1)
        hidden = hidden + linear(F.silu(gate) * up, self.down.weight)
        return self.final_norm(hidden)


def shifted_within_sequences(
    values: torch.Tensor, cu_seqlens: Sequence[int], shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values[t + shift], valid [T] bool)``: valid where ``t + shift`` is in t's sequence."""
    num_tokens = values.shape[0]
    index = torch.arange(num_tokens) + shift
    ends = torch.zeros(num_tokens, dtype=torch.long)
    for start, end in itertools.pairwise(cu_seqlens):
        ends[start:end] = end
    valid = index < ends
    return values[index.clamp(max=num_tokens - 1)], valid


def mtp_distillation_loss(
    heads: Sequence[MTPHead],
    trunk_hidden: torch.Tensor,
    main_logits: torch.Tensor,
    input_ids: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cu_seqlens: Sequence[int],
) -> tuple[torch.Tensor, list[float]]:
    """Mean over heads of KL(main head's distribution || head's distribution), per token.

    ``main_logits [T, V]`` are the trunk's float32 logits at every position; head ``d``
    at position ``t`` is compared with them at ``t + d``. Returns the loss and the KL of
    each head (for metrics).
    """
    target_log_probs = torch.log_softmax(main_logits.detach(), dim=-1)
    previous = trunk_hidden.detach()
    losses: list[torch.Tensor] = []
    for depth, head in enumerate(heads, start=1):
        next_ids, valid = shifted_within_sequences(input_ids, cu_seqlens, depth)
        next_embeddings = F.embedding(next_ids, embed).to(previous.dtype)
        previous = head(previous, next_embeddings, rope, cu_seqlens)
        targets, _ = shifted_within_sequences(target_log_probs, cu_seqlens, depth)
        if not bool(valid.any()):
            losses.append(previous.sum() * 0.0)
            continue
        log_q = torch.log_softmax(linear(previous[valid], lm_head).float(), dim=-1)
        log_p = targets[valid]
        kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean()
        losses.append(kl)
    return torch.stack(losses).mean(), [float(loss.detach()) for loss in losses]
