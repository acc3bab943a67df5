"""`etude bench trainer`: the FLOP count from the model's shape, and the output contract
(quick run)."""

from __future__ import annotations

import pytest
import torch

from services.bench.trainer import forward_flops, matmul_peak_gflops, run, step_flops
from services.trainer.model import Architecture, PackedInputs

ARCH = Architecture(
    vocab_size=100,
    hidden_size=16,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=8,
    max_position_embeddings=64,
)
# Per token and layer: q, o 16*32 each, k, v 16*16 each, router 16*4, 2 experts of 3*16*8.
PER_TOKEN_MACS = 2 * 16 * 32 + 2 * 16 * 16 + 16 * 4 + 2 * 3 * 16 * 8


def test_forward_flops_count_projections_experts_attention_pairs_and_the_head() -> None:
    packed = PackedInputs.pack([[1, 2, 3], [4, 5]])
    pairs = (1 + 2 + 3) + (1 + 2)  # causal, within each sequence
    per_layer = 2 * PER_TOKEN_MACS * 5 + 4 * 4 * 8 * pairs
    assert forward_flops(ARCH, packed, 3) == 2 * per_layer + 2 * 16 * 100 * 3
    assert step_flops(ARCH, packed, 3, reference=True) == 4 * forward_flops(ARCH, packed, 3)
    assert step_flops(ARCH, packed, 3, reference=False) == 3 * forward_flops(ARCH, packed, 3)


def test_a_prefix_tree_run_attends_to_its_ancestors_keys() -> None:
    tree, _ = PackedInputs.pack_shared(
        [[7, 8, 9, 1], [7, 8, 9, 2, 3]], [[False, False, True, True], [False] * 3 + [True] * 2]
    )
    assert tree.ancestors is not None and any(tree.ancestors)
    lengths = [b - a for a, b in zip(tree.cu_seqlens, tree.cu_seqlens[1:], strict=False)]
    pairs = 0
    for run_index, length in enumerate(lengths):
        prefix = sum(lengths[a] for a in tree.ancestors[run_index])
        pairs += length * prefix + length * (length + 1) // 2
    tokens = int(tree.input_ids.shape[0])
    assert tokens < 9  # the shared prefix once
    expected = 2 * (2 * PER_TOKEN_MACS * tokens + 4 * 4 * 8 * pairs)
    assert forward_flops(ARCH, tree, 0) == expected


def test_matmul_peak_is_positive() -> None:
    assert matmul_peak_gflops(torch.float32, size=64, repeats=2) > 0


@pytest.mark.slow
def test_quick_run_reports_the_figures() -> None:
    result = run(quick=True).to_json("trainer")
    figures = result["figures"]
    for name in ("rl_speedup", "sft_speedup", "mfu_rl", "mfu_sft", "peak_gflops"):
        assert figures[name] > 0, name
    assert 0 < figures["mfu_rl"] < 1 and 0 < figures["mfu_sft"] < 1
    assert set(result["baseline"]) == {"rl_tokens_per_s", "sft_tokens_per_s"}
    details = result["details"]
    assert details["rl"]["tokens_computed"] < details["rl"]["tokens"]
