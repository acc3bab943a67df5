"""The losses: Dr. GRPO with a truncated importance ratio and a k1 KL penalty; next-token CE.

Policy loss, over the generated tokens ``t`` of every rollout ``i`` in the step::

    w_t   = min(pi_theta(t) / pi_behaviour(t), c)            truncated importance ratio
    k1_t  = -log(pi_ref(t) / pi_theta(t)) = log pi_theta(t) - log pi_ref(t)
    L     = 1 / (N * B) * sum_i g_i * sum_t  sg(w_t) * (-(A_i - beta * sg(k1_t))) * s_t

with ``s_t = exp(log pi_theta(t) - sg(log pi_theta(t)))`` (value 1, gradient
``grad log pi_theta(t)``), ``sg`` stop-gradient, ``A_i`` the Dr. GRPO advantage, ``g_i``
the staleness weight of the rollout's group, ``N`` the number of rollouts in the step
and ``B`` the generation budget: token sums divided by a constant, never by a
rollout's own length. The gradient is the truncated-IS policy gradient
``sum w_t (A_i - beta k1_t) grad log pi_theta(t)``: the KL enters as a per-token k1
penalty on the reward (the estimator whose score-function gradient is unbiased for the
KL's gradient; differentiating k3 as a loss is biased), and the importance weight
corrects for inference being behind the trainer or numerically different from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLoss:
    """The loss to differentiate, its parts, and per-token statistics (detached)."""

    loss: torch.Tensor
    policy_gradient: torch.Tensor  # value of the advantage part
    kl_penalty: torch.Tensor  # value of the beta * k1 part
    importance_ratio: torch.Tensor  # [N] pi_theta / pi_behaviour before truncation
    clipped: torch.Tensor  # [N] bool: the ratio was truncated
    k1: torch.Tensor  # [N] log pi_theta - log pi_ref (zeros without a reference)


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    normalizer: float,
    importance_cap: float,
    kl_coef: float = 0.0,
    reference_logprobs: torch.Tensor | None = None,
) -> PolicyLoss:
    """The policy loss over trained tokens (all arguments ``[N]``, one entry per token)."""
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if kl_coef > 0 and reference_logprobs is None:
        raise ValueError(f"kl_coef = {kl_coef} needs reference_logprobs (got None)")
    detached = logprobs.detach()
    ratio = torch.exp(detached - behaviour_logprobs)
    truncated = ratio.clamp(max=importance_cap)
    k1 = (
        detached - reference_logprobs
        if reference_logprobs is not None
        else torch.zeros_like(detached)
    )
    score = torch.exp(logprobs - detached)
    scale = truncated * weights / normalizer
    policy_gradient = -(scale * advantages * score).sum()
    kl_penalty = (scale * kl_coef * k1 * score).sum()
    return PolicyLoss(
        loss=policy_gradient + kl_penalty,
        policy_gradient=policy_gradient.detach(),
        kl_penalty=kl_penalty.detach(),
        importance_ratio=ratio,
        clipped=ratio > importance_cap,
        k1=k1,
    )


def next_token_loss(logprobs: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Summed negative log-likelihood of the trained tokens over ``normalizer``.

    The SFT/CPT step passes the number of trained tokens of the whole step, so the
    microbatches of a step add up to the mean over its tokens.
    """
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return -logprobs.sum() / normalizer
