"""A tiny MoE trained 200 steps with the NVFP4-forward/MXFP8-backward recipe ends within
5% of the bf16 loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.trainer.precision import MoELayer, Precision

# 2 x 200 training steps: a minute or more on 2 busy cores.
pytestmark = pytest.mark.slow

VOCAB, D_MODEL, D_FF, NUM_EXPERTS, TOP_K = 32, 64, 64, 4, 2
NUM_STEPS, BATCH = 200, 512


class TinyMoEModel(nn.Module):
    """Predicts the next token from the two before it through one residual MoE block."""

    def __init__(self, precision: Precision) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.previous = nn.Parameter(torch.randn(VOCAB, D_MODEL, generator=generator))
        self.current = nn.Parameter(torch.randn(VOCAB, D_MODEL, generator=generator))
        self.norm = nn.RMSNorm(D_MODEL)
        self.moe = MoELayer(NUM_EXPERTS, D_MODEL, D_FF, TOP_K, precision, generator=generator)
        self.head = nn.Parameter(
            torch.randn(VOCAB, D_MODEL, generator=generator) / math.sqrt(D_MODEL)
        )

    def forward(self, previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        hidden = self.previous[previous] + self.current[current]
        hidden = hidden + self.moe(self.norm(hidden))
        return hidden @ self.head.T


def _train(precision: Precision) -> tuple[float, float]:
    """(mean loss of the first 10 steps, mean loss of the last 20) on a 2nd-order Markov chain."""
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1)
    transitions = torch.softmax(3 * torch.randn(VOCAB, VOCAB, VOCAB, generator=data), dim=-1)
    model = TinyMoEModel(precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(NUM_STEPS):
        previous = torch.randint(0, VOCAB, (BATCH,), generator=data)
        current = torch.randint(0, VOCAB, (BATCH,), generator=data)
        target = torch.multinomial(transitions[previous, current], 1, generator=data).squeeze(-1)
        loss = F.cross_entropy(model(previous, current), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses[:10]) / 10, sum(losses[-20:]) / 20


def test_nvfp4_fwd_mxfp8_bwd_training_ends_within_5_percent_of_bf16() -> None:
    bf16_start, bf16_end = _train("bf16")
    recipe_start, recipe_end = _train("nvfp4_fwd_mxfp8_bwd")
    # Both learn (the losses fall well below the start), so the comparison means something.
    assert bf16_end < 0.6 * bf16_start and recipe_end < 0.6 * recipe_start
    assert abs(recipe_end - bf16_end) <= 0.05 * bf16_end, (bf16_end, recipe_end)
