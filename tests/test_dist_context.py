"""Context parallelism in one process: the chunk assignment balances causal attention,
each rank's tokens are the right ones, and the ranks' attention together is exactly
causal attention within each packed sequence.

``ContextParallelAttention`` gathers the group's keys and values with a collective; here
every rank's share is computed in one process and the gather is replaced by the
concatenation the collective returns (the collective itself runs in
``tests/test_dist_layouts.py``, under gloo, against the single-process model).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.nn.functional as F

from services.trainer.distributed import context_parallel
from services.trainer.distributed.context_parallel import (
    ContextParallelAttention,
    check_divisible,
    held_chunks,
    local_token_index,
    rank_attention_pairs,
    shard_inputs,
)
from services.trainer.model import PackedInputs
from services.trainer.model.layers import causal_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def spread(values: Sequence[float]) -> float:
    """``(max - min) / max``: 0 when every rank does the same work."""
    return (max(values) - min(values)) / max(values)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_attention_work_is_balanced_for_every_divisible_length(cp: int) -> None:
    """Query-key pairs per rank (the attention FLOPs are these x 4 x heads x head_dim)."""
    for length in range(2 * cp, 4096 + 1, 2 * cp):
        pairs = rank_attention_pairs(length, cp)
        assert sum(pairs) == length * (length + 1) // 2, length
        assert spread(pairs) < 0.05, (length, pairs)
        chunk = length // (2 * cp)
        assert pairs == [(2 * cp - 1) * chunk**2 + chunk * (chunk + 1)] * cp


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_contiguous_chunks_would_not_balance(cp: int) -> None:
    """Why two chunks: cutting into cp contiguous pieces gives the last rank ~2cp-1 times
    the first one's work."""
    length = 512 * cp
    piece = length // cp
    pairs = [sum(range(r * piece + 1, (r + 1) * piece + 1)) for r in range(cp)]
    assert spread(pairs) > 0.6
    assert spread(rank_attention_pairs(length, cp)) == 0


def packed(lengths: Sequence[int]) -> PackedInputs:
    return PackedInputs.pack([[7 + i] * n for i, n in enumerate(lengths)])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_local_token_index_splits_each_packed_sequence_into_its_chunks(cp: int) -> None:
    lengths = [2 * cp * n for n in (3, 1, 7, 2)]
    inputs = packed(lengths)
    indices = [local_token_index(inputs.cu_seqlens, r, cp) for r in range(cp)]
    # Together the ranks hold every token once, each rank the same number.
    assert sorted(torch.cat(indices).tolist()) == list(range(sum(lengths)))
    assert {len(index) for index in indices} == {sum(lengths) // cp}
    for rank, index in enumerate(indices):
        sharded = shard_inputs(inputs, rank, cp)
        assert sharded.cu_seqlens == [start // cp for start in inputs.cu_seqlens]
        assert torch.equal(sharded.input_ids, inputs.input_ids[index])
        for sequence, (start, end) in enumerate(itertools.pairwise(sharded.cu_seqlens)):
            # Its own sequence's tokens only, in two chunks at their true positions.
            assert set(sharded.input_ids[start:end].tolist()) == {7 + sequence}
            chunk = lengths[sequence] // (2 * cp)
            expected = torch.cat(
                [torch.arange(c * chunk, (c + 1) * chunk) for c in held_chunks(rank, cp)]
            )
            assert torch.equal(sharded.position_ids[start:end], expected)


def _gathered_from(keys_values: list[torch.Tensor]) -> object:
    """What ``gather_from_group`` returns on every rank: the ranks' tensors in order."""

    def gather(x: torch.Tensor, group: object, size: int) -> torch.Tensor:
        assert size == len(keys_values)
        return torch.cat(keys_values)

    return gather


def _context_parallel_outputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: list[int],
    cp: int,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's ``(token index, attention output)`` for the packed stream."""
    indices = [local_token_index(cu_seqlens, r, cp) for r in range(cp)]
    shares = [torch.stack([key[i], value[i]], dim=1) for i in indices]
    monkeypatch.setattr(context_parallel, "gather_from_group", _gathered_from(shares))
    local_cu = [start // cp for start in cu_seqlens]
    for rank, index in enumerate(indices):
        attention = ContextParallelAttention(group=None, cp_index=rank, cp=cp)  # type: ignore[arg-type]
        yield index, attention(query[index], key[index], value[index], local_cu)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ranks_together_compute_causal_attention_within_each_sequence(
    cp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = [2 * cp * n for n in (5, 1, 3, 8)]
    cu_seqlens = packed(lengths).cu_seqlens
    generator = torch.Generator().manual_seed(cp)
    total = sum(lengths)
    query = torch.randn(total, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    key = torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    value = torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    expected = causal_attention(query, key, value, cu_seqlens)

    combined = torch.full_like(expected, float("nan"))
    for index, output in _context_parallel_outputs(query, key, value, cu_seqlens, cp, monkeypatch):
        combined[index] = output
    torch.testing.assert_close(combined, expected, rtol=1e-12, atol=1e-12)

    # Nothing crosses a boundary: the other sequences' keys and values change no output
    # of the first sequence.
    key[cu_seqlens[1] :] = torch.randn_like(key[cu_seqlens[1] :])
    value[cu_seqlens[1] :] = 0
    for index, output in _context_parallel_outputs(query, key, value, cu_seqlens, cp, monkeypatch):
        in_first = index < cu_seqlens[1]
        torch.testing.assert_close(output[in_first], expected[index[in_first]], rtol=0, atol=1e-12)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_attention_flops_of_the_implementation_balance_over_ranks(
    cp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FLOPs each rank's attention calls do (``4 * heads * Lq * Lk * head_dim`` per
    call, dense over the masked block), counted on a packed batch of several lengths."""
    flops = [0] * cp
    rank_of_call = [0]
    real = F.scaled_dot_product_attention

    def counting(
        query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        heads, queries, dim = query.shape[-3:]
        flops[rank_of_call[0]] += 4 * heads * queries * key.shape[-2] * dim
        return real(query, key, *args, **kwargs)  # type: ignore[arg-type]

    lengths = [2 * cp * n for n in (1, 16, 5, 64)]
    cu_seqlens = packed(lengths).cu_seqlens
    total = sum(lengths)
    query = torch.randn(total, HEADS, HEAD_DIM)
    key, value = torch.randn(total, KV_HEADS, HEAD_DIM), torch.randn(total, KV_HEADS, HEAD_DIM)
    outputs = _context_parallel_outputs(query, key, value, cu_seqlens, cp, monkeypatch)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    for rank in range(cp):
        rank_of_call[0] = rank
        next(outputs)
    assert spread(flops) < 0.05, flops
    # Dense blocks: each rank computes (2 cp + 1) chunk**2 query-key products per sequence.
    pairs = sum((2 * cp + 1) * (n // (2 * cp)) ** 2 for n in lengths)
    assert flops == [4 * HEADS * HEAD_DIM * pairs] * cp


def test_a_length_cp_does_not_divide_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"cp = 4 .* multiples of 8, got \[12, 6\]"):
        check_divisible([16, 12, 8, 6], 4)
    inputs = packed([8, 10])
    with pytest.raises(ValueError, match="cp = 2"):
        shard_inputs(inputs, 0, 2)
    with pytest.raises(ValueError, match=r"cp_index must be in \[0, 2\)"):
        held_chunks(2, 2)
