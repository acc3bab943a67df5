"""The MoE router of Qwen3-MoE, with router replay and its plausibility filter.

Routing follows Qwen3-MoE: logits from the hidden state (in the compute dtype, as
transformers and vLLM compute them, so near-ties break the same way), softmax in
float32, the top-k experts, their probabilities renormalized to sum to 1.

**Router replay**: given the experts inference chose for a token (per layer), the
layer routes the token to exactly those experts; the gate weights are still the
router's own softmax probabilities of those experts (renormalized), so the router
keeps receiving gradients. Without replay, a bf16 rounding difference between the
trainer and inference flips near-tied routes, and the recomputed logprob of a
sampled token comes from a different network than the one that sampled it.

**Plausibility filter**: a replayed expert whose router probability is below
``min_prob_ratio`` times the router's own k-th largest probability is implausible
(stale policy, corrupted record); it is replaced by the router's most probable
expert not already chosen for that token. A duplicated replayed expert is replaced
the same way. Replacements are counted per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.trainer.model.layers import linear


@dataclass
class RoutingDecision:
    """Where one layer sends each token, and with which weights."""

    experts: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k] float32, differentiable w.r.t. the router
    num_replaced: int  # replayed choices the filter replaced
    num_replayed: int  # tokens routed by replay


def filter_replay(
    probs: torch.Tensor,
    replayed: torch.Tensor,
    kth_largest: torch.Tensor,
    min_prob_ratio: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(experts [T, k], replaced [T, k] bool)`` for ``replayed [T, k]`` under ``probs [T, E]``.

    A choice is replaced when its probability is below ``min_prob_ratio * kth_largest``
    (per token) or when it repeats an earlier choice of the same token. The replacement
    is the most probable expert not already chosen; it is always plausible, since at most
    k - 1 of the router's own top-k experts can be taken by the other choices.
    """
    experts = replayed.clone()
    threshold = (min_prob_ratio * kth_largest)[:, None]
    replaced = probs.gather(1, experts) < threshold
    top_k = experts.shape[1]
    for slot in range(1, top_k):
        replaced[:, slot] |= (experts[:, slot : slot + 1] == experts[:, :slot]).any(dim=1)
    for slot in range(top_k):
        need = replaced[:, slot]
        if not bool(need.any()):
            continue
        taken = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, experts, True)
        best = probs.masked_fill(taken, -1.0).argmax(dim=1)
        experts[:, slot] = torch.where(need, best, experts[:, slot])
    return experts, replaced


class Router(nn.Module):
    """Softmax top-k router (``mlp.gate`` in the HF layout) with optional replay."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, *, normalize: bool = True
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize

    def forward(
        self,
        x: torch.Tensor,
        replay: torch.Tensor | None = None,
        replay_mask: torch.Tensor | None = None,
        min_prob_ratio: float = 0.0,
    ) -> RoutingDecision:
        """Routes ``x [T, hidden]``; ``replay [T, k]`` applies where ``replay_mask [T]`` is set."""
        probs = torch.softmax(linear(x, self.weight).float(), dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)
        num_replaced = num_replayed = 0
        experts = top_experts
        if replay is not None:
            with torch.no_grad():
                mask = (
                    torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
                    if replay_mask is None
                    else replay_mask
                )
                filtered, replaced = filter_replay(
                    probs.detach(), replay, top_probs.detach()[:, -1], min_prob_ratio
                )
                experts = torch.where(mask[:, None], filtered, top_experts)
                num_replaced = int((replaced & mask[:, None]).sum())
                num_replayed = int(mask.sum())
        # Under replay the gates are the router's probabilities of the replayed experts.
        weights = top_probs if experts is top_experts else probs.gather(1, experts)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RoutingDecision(experts, weights, num_replaced, num_replayed)
