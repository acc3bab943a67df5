"""Global sequence packing: a step's sequences over the data-parallel ranks, then into
microbatches, balanced by attention-weighted cost.

RL rollouts range from a few hundred tokens to the whole context, and attention makes a
long one cost more than its share of tokens: a sequence of ``L`` tokens costs
``a * L + b * L**2`` (``CostModel``; ``a`` covers the projections and experts, ``b``
causal attention, both measured by ``services.trainer.distributed.calibration``).
Before each step the trainer splits the batch's sequences into one part per dp rank
with equal summed cost:

* ``karmarkar_karp`` — the largest differencing method for k-way partitioning
  (Karmarkar & Karp 1982; Korf's multiway form): every sequence starts as a k-tuple
  ``(cost, 0, ..., 0)``; the two tuples whose spread (largest minus smallest) is widest
  are repeatedly merged, the largest part of one with the smallest of the other, until
  one tuple is left. Compiled with numba: 100,000 sequences over 64 ranks take about
  0.15 s on one core (``etude bench packing``).
* ``sorted_greedy`` (longest processing time first) and ``round_robin`` — the baselines
  the benchmark compares against.

A group's rollouts may land on different ranks: advantages are computed before
packing. Each rank's part is then cut into microbatches under a token budget
(``pack_microbatches``); every rank runs the same number of microbatches (the expert
all-to-alls and the sharded weights' gathers are collectives), balanced by cost too, and
a rank with nothing left for a microbatch runs a padding sequence that trains nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np


@dataclass(frozen=True)
class CostModel:
    """``cost(L) = per_token * L + per_token_pair * L**2``."""

    per_token: float = 1.0
    per_token_pair: float = 0.0

    def costs(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """The cost of each length (float64)."""
        values = np.asarray(lengths, dtype=np.float64)
        return self.per_token * values + self.per_token_pair * values * values


def imbalance(costs: np.ndarray, parts: Sequence[Sequence[int]]) -> float:
    """``max / mean`` of the parts' summed costs (1.0 is perfect)."""
    loads = np.array([float(costs[list(part)].sum()) for part in parts])
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def round_robin(costs: np.ndarray, num_parts: int) -> list[list[int]]:
    """Sequence ``i`` to part ``i % num_parts`` (the baseline that ignores cost)."""
    return [list(range(part, len(costs), num_parts)) for part in range(num_parts)]


def sorted_greedy(costs: np.ndarray, num_parts: int) -> list[list[int]]:
    """Costliest first, each to the currently cheapest part (LPT)."""
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0.0, part) for part in range(num_parts)]
    for index in np.argsort(-costs, kind="stable"):
        load, part = heapq.heappop(heap)
        parts[part].append(int(index))
        heapq.heappush(heap, (load + float(costs[index]), part))
    return parts


def karmarkar_karp(costs: np.ndarray, num_parts: int) -> list[list[int]]:
    """Partitions the indices of ``costs`` into ``num_parts`` parts of near-equal cost."""
    _check(costs, num_parts)
    if len(costs) == 0:
        return [[] for _ in range(num_parts)]
    heads, following = _differencing(np.ascontiguousarray(costs, dtype=np.float64), num_parts)
    parts = []
    for head in heads:
        members, item = [], int(head)
        while item >= 0:
            members.append(item)
            item = int(following[item])
        parts.append(sorted(members))
    return parts


def _check(costs: np.ndarray, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if costs.ndim != 1 or not np.isfinite(costs).all() or (costs < 0).any():
        raise ValueError("costs must be a 1-D array of finite, non-negative numbers")


@numba.njit(cache=True)
def _before(spread: np.ndarray, a: int, b: int) -> bool:
    """Heap order: wider spread first, then lower tuple id (deterministic)."""
    return spread[a] > spread[b] or (spread[a] == spread[b] and a < b)


@numba.njit(cache=True)
def _sift_down(heap: np.ndarray, size: int, spread: np.ndarray, position: int) -> None:
    while True:
        child = 2 * position + 1
        if child >= size:
            return
        if child + 1 < size and _before(spread, heap[child + 1], heap[child]):
            child += 1
        if not _before(spread, heap[child], heap[position]):
            return
        heap[child], heap[position] = heap[position], heap[child]
        position = child


@numba.njit(cache=True)
def _differencing(costs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Largest differencing; returns each part's first item and the next-item links.

    Tuple ``t`` (initially sequence ``t`` alone) keeps its ``k`` part sums sorted in
    descending order, and each part's items as a linked list (``head``, ``tail``,
    ``following``), so a merge costs ``O(k log k)`` whatever the parts hold.
    """
    n = costs.shape[0]
    sums = np.zeros((n, k))
    head = np.full((n, k), -1, dtype=np.int32)
    tail = np.full((n, k), -1, dtype=np.int32)
    following = np.full(n, -1, dtype=np.int32)
    spread = np.empty(n)
    for item in range(n):
        sums[item, 0] = costs[item]
        head[item, 0] = item
        tail[item, 0] = item
        spread[item] = costs[item]
    heap = np.arange(n)
    for position in range(n // 2 - 1, -1, -1):
        _sift_down(heap, n, spread, position)
    size = n
    merged_sums = np.empty(k)
    merged_head = np.empty(k, dtype=np.int32)
    merged_tail = np.empty(k, dtype=np.int32)
    while size > 1:
        first = heap[0]
        size -= 1
        heap[0] = heap[size]
        _sift_down(heap, size, spread, 0)
        second = heap[0]
        # The largest part of one with the smallest of the other: the spreads cancel.
        for slot in range(k):
            other = k - 1 - slot
            merged_sums[slot] = sums[first, slot] + sums[second, other]
            left_head, left_tail = head[first, slot], tail[first, slot]
            right_head, right_tail = head[second, other], tail[second, other]
            if left_head < 0:
                merged_head[slot], merged_tail[slot] = right_head, right_tail
            else:
                merged_head[slot] = left_head
                if right_head >= 0:
                    following[left_tail] = right_head
                    merged_tail[slot] = right_tail
                else:
                    merged_tail[slot] = left_tail
        order = np.argsort(-merged_sums, kind="mergesort")
        for slot in range(k):
            sums[first, slot] = merged_sums[order[slot]]
            head[first, slot] = merged_head[order[slot]]
            tail[first, slot] = merged_tail[order[slot]]
        spread[first] = sums[first, 0] - sums[first, k - 1]
        heap[0] = first  # in place of `second`, now part of it
        _sift_down(heap, size, spread, 0)
    root = heap[0]
    return head[root].copy(), following


def pack_microbatches(
    lengths: np.ndarray,
    costs: np.ndarray,
    members: Sequence[int],
    token_budget: int,
    num_microbatches: int | None = None,
) -> list[list[int]] | None:
    """``members`` (indices) into microbatches of at most ``token_budget`` tokens.

    Costliest first, each into the cheapest bin with room (an empty bin takes any
    sequence: one longer than the budget runs alone). With ``num_microbatches`` there are
    exactly that many bins (some may stay empty) and None says the sequences do not fit;
    without it a bin is opened whenever none has room.
    """
    bins: list[list[int]] = [[] for _ in range(num_microbatches or 1)]
    tokens = [0] * len(bins)
    heap = [(0.0, b) for b in range(len(bins))]
    for index in sorted(members, key=lambda i: (-costs[i], i)):
        length = int(lengths[index])
        chosen: int | None = None
        passed: list[tuple[float, int]] = []
        while heap:
            load, candidate = heapq.heappop(heap)
            if not bins[candidate] or tokens[candidate] + length <= token_budget:
                chosen = candidate
                break
            passed.append((load, candidate))
            if num_microbatches is None:
                break  # bins fill evenly: when the cheapest has no room, open one
        for entry in passed:
            heapq.heappush(heap, entry)
        if chosen is None:
            if num_microbatches is not None:
                return None
            load, chosen = 0.0, len(bins)
            bins.append([])
            tokens.append(0)
        bins[chosen].append(index)
        tokens[chosen] += length
        heapq.heappush(heap, (load + float(costs[index]), chosen))
    return [sorted(members_of_bin) for members_of_bin in bins]


def plan_step(
    lengths: Sequence[int] | np.ndarray, num_ranks: int, token_budget: int, cost_model: CostModel
) -> list[list[list[int]]]:
    """``plan[rank][microbatch]``: indices of the sequences each dp rank trains, per
    microbatch; every rank gets the same number of microbatches (some may be empty)."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    length_array = np.asarray(lengths, dtype=np.int64)
    costs = cost_model.costs(length_array)
    parts = karmarkar_karp(costs, num_ranks)
    # The rank that needs the most microbatches on its own sets the count for all.
    count = 1
    for part in parts:
        own = pack_microbatches(length_array, costs, part, token_budget)
        count = max(count, len(own or []))
    while True:
        plan = [pack_microbatches(length_array, costs, part, token_budget, count) for part in parts]
        if all(bins is not None for bins in plan):
            return [bins for bins in plan if bins is not None]
        count += 1
