"""Global sequence packing: the partitioners, microbatches under a token budget, the step
plan, a group split over ranks, and the `etude bench packing` contract (no timing)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from services.api.v1 import common_pb2
from services.bench.packing import Partitioner, rollout_lengths
from services.bench.packing import run as run_bench
from services.trainer.batch import PulledGroup, collect_rl_items
from services.trainer.distributed.batching import assign, local_microbatches
from services.trainer.distributed.calibration import fit
from services.trainer.distributed.layout import ParallelLayout
from services.trainer.distributed.packing import (
    CostModel,
    imbalance,
    karmarkar_karp,
    pack_microbatches,
    plan_step,
    round_robin,
    sorted_greedy,
)
from services.trainer.rollouts import Rollout, SegmentTokens

PARTITIONERS: list[Partitioner] = [karmarkar_karp, sorted_greedy, round_robin]
RL_COST = CostModel(1.0, 4e-5)  # the trainer's default b / a


def largest_part(costs: np.ndarray, parts: list[list[int]]) -> float:
    return max((float(costs[part].sum()) for part in parts), default=0.0)


def brute_force_optimum(costs: np.ndarray, num_parts: int) -> float:
    """The smallest possible largest part, over every assignment of items to parts."""
    assignments = np.array(list(itertools.product(range(num_parts), repeat=len(costs))))
    loads = np.stack([(costs * (assignments == p)).sum(axis=1) for p in range(num_parts)], 1)
    return float(loads.max(axis=1).min())


@pytest.mark.parametrize("partition", PARTITIONERS, ids=lambda f: f.__name__)
def test_every_index_lands_in_exactly_one_part(partition: Partitioner) -> None:
    rng = np.random.default_rng(0)
    for num_items, num_parts in [(0, 3), (1, 4), (3, 8), (10, 1), (57, 7), (1000, 64)]:
        costs = rng.lognormal(0, 2, num_items)
        parts = partition(costs, num_parts)
        assert len(parts) == num_parts
        assert sorted(i for part in parts for i in part) == list(range(num_items))


def test_karmarkar_karp_against_the_brute_force_optimum_on_small_cases() -> None:
    """Largest differencing is a heuristic: optimal on most small cases, and never worse
    than its proven ratio (7/6 for two parts, 4/3 - 1/(3k) for k; Michiels et al. 2007)."""
    rng = np.random.default_rng(1)
    optimal = total = 0
    for num_parts in (2, 3, 4):
        for _ in range(60):
            costs = rng.integers(1, 100, int(rng.integers(num_parts, 8))).astype(np.float64)
            best = brute_force_optimum(costs, num_parts)
            found = largest_part(costs, karmarkar_karp(costs, num_parts))
            bound = 7 / 6 if num_parts == 2 else 4 / 3 - 1 / (3 * num_parts)
            assert best <= found <= bound * best + 1e-9, (costs, num_parts)
            optimal += found == best
            total += 1
    assert optimal >= 0.85 * total


def test_karmarkar_karp_finds_known_optima() -> None:
    # Fewer items than parts, or as many: each alone.
    costs = np.array([5.0, 1.0, 3.0])
    assert sorted(map(sorted, karmarkar_karp(costs, 4))) == [[], [0], [1], [2]]
    # A perfect split LPT misses: {8, 7} | {6, 5, 4}, LPT gives 17 | 13, KK 16 | 14.
    costs = np.array([8.0, 7.0, 6.0, 5.0, 4.0])
    assert largest_part(costs, sorted_greedy(costs, 2)) == 17
    assert largest_part(costs, karmarkar_karp(costs, 2)) == 16
    # Equal costs split as evenly as counts allow.
    parts = karmarkar_karp(np.ones(10), 4)
    assert sorted(len(part) for part in parts) == [2, 2, 3, 3]


@pytest.mark.parametrize(("num_sequences", "num_ranks"), [(256, 8), (2048, 64), (10_000, 64)])
def test_on_heavy_tailed_lengths_karmarkar_karp_beats_greedy_beats_round_robin(
    num_sequences: int, num_ranks: int
) -> None:
    costs = RL_COST.costs(rollout_lengths(num_sequences))
    kk, greedy, robin = (imbalance(costs, f(costs, num_ranks)) for f in PARTITIONERS)
    assert kk <= greedy <= robin
    assert kk <= 1.02
    assert robin > 1.05  # the lengths are skewed enough for the comparison to mean something


def test_karmarkar_karp_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_parts must be >= 1"):
        karmarkar_karp(np.ones(3), 0)
    with pytest.raises(ValueError, match="non-negative"):
        karmarkar_karp(np.array([1.0, -2.0]), 2)
    with pytest.raises(ValueError, match="finite"):
        karmarkar_karp(np.array([1.0, math.nan]), 2)
    with pytest.raises(ValueError, match="token_budget must be >= 1"):
        plan_step([10, 20], 2, 0, RL_COST)


def test_pack_microbatches_respects_the_token_budget() -> None:
    lengths = rollout_lengths(300, seed=3)
    costs = RL_COST.costs(lengths)
    members = list(range(0, 300, 2))
    budget = 16_384
    bins = pack_microbatches(lengths, costs, members, budget)
    assert bins is not None
    assert sorted(i for b in bins for i in b) == members
    for b in bins:
        # Over the budget only as a lone sequence that is longer than the budget by itself.
        assert lengths[b].sum() <= budget or (len(b) == 1 and lengths[b[0]] > budget)
    assert any(len(b) == 1 and lengths[b[0]] > budget for b in bins), "the tail was exercised"

    fixed = pack_microbatches(lengths, costs, members, budget, num_microbatches=len(bins) + 3)
    assert fixed is not None and len(fixed) == len(bins) + 3
    assert sorted(i for b in fixed for i in b) == members
    assert all(lengths[b].sum() <= budget or len(b) == 1 for b in fixed)
    # Three sequences of 600 tokens cannot fit in two microbatches of 1,000.
    assert pack_microbatches(np.full(3, 600), np.ones(3), [0, 1, 2], 1000, 2) is None


@pytest.mark.parametrize(("num_ranks", "budget"), [(1, 8192), (4, 20_000), (16, 65_536)])
def test_plan_step_gives_every_rank_as_many_microbatches_under_the_budget(
    num_ranks: int, budget: int
) -> None:
    lengths = rollout_lengths(400, seed=num_ranks)
    plan = plan_step(lengths.tolist(), num_ranks, budget, RL_COST)
    assert len(plan) == num_ranks
    assert len({len(bins) for bins in plan}) == 1
    indices = sorted(i for bins in plan for b in bins for i in b)
    assert indices == list(range(len(lengths)))
    for bins in plan:
        for b in bins:
            assert lengths[b].sum() <= budget or len(b) == 1
    costs = RL_COST.costs(lengths)
    rank_parts = [[i for b in bins for i in b] for bins in plan]
    assert imbalance(costs, rank_parts) <= 1.02


def _group(group_index: int, rewards: list[float], length: int) -> PulledGroup:
    """A group of one-segment rollouts; token ids encode (group, rollout) to find them later."""
    summaries, rollouts = [], []
    for rollout_index, reward in enumerate(rewards):
        token = 1 + 10 * group_index + rollout_index
        segment = SegmentTokens(
            input_ids=[token] * (length + 3 * rollout_index),
            targets=[token] * (length + 3 * rollout_index),
            trained=[True] * (length + 3 * rollout_index),
            behaviour_logprobs=[-1.0] * (length + 3 * rollout_index),
            replay=None,
        )
        summaries.append(common_pb2.RolloutSummary(reward=common_pb2.RewardParts(total=reward)))
        rollouts.append(Rollout(f"g{group_index}-r{rollout_index}", reward, [segment]))
    return PulledGroup(f"g{group_index}", 1.0, summaries, rollouts)


def test_a_group_split_over_ranks_keeps_the_advantages_computed_before_packing() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]]
    groups = [_group(g, r, 40 + 17 * g) for g, r in enumerate(rewards)]
    collected = collect_rl_items(groups)
    layout = ParallelLayout.resolve(8, dp=4, cp=2, num_experts=4)
    parts = assign(collected.items, layout, RL_COST, token_budget=128)

    expected = {
        1 + 10 * g + r: reward - sum(group) / len(group)
        for g, group in enumerate(rewards)
        for r, reward in enumerate(group)
    }
    ranks_of_group: dict[int, set[int]] = {}
    for dp_index, part in enumerate(parts):
        for cp_index in range(layout.cp):
            for microbatch in local_microbatches(part, layout, cp_index, num_layers=1, top_k=1):
                assert microbatch.padding is not None
                real = ~microbatch.padding
                tokens = microbatch.inputs.input_ids[real].tolist()
                advantages = microbatch.advantages[real].tolist()
                for token, advantage in zip(tokens, advantages, strict=True):
                    assert advantage == pytest.approx(expected[token])
                    ranks_of_group.setdefault((token - 1) // 10, set()).add(dp_index)
                # Padding trains nothing.
                assert not microbatch.trained[microbatch.padding].any()
    assert set(ranks_of_group) == {0, 1, 2}
    assert any(len(ranks) > 1 for ranks in ranks_of_group.values()), "a group was split"


@pytest.mark.slow
def test_bench_packing_contract() -> None:
    answer = run_bench(True).to_json("packing")
    assert set(answer) >= {"bench", "figures", "baseline", "ok", "target", "details"}
    figures, baseline = answer["figures"], answer["baseline"]
    assert set(figures) == {
        "imbalance",
        "imbalance_vs_sorted_greedy",
        "imbalance_vs_round_robin",
        "seconds_100k",
        "seconds_vs_sorted_greedy",
    }
    assert set(baseline) == {
        "sorted_greedy_imbalance",
        "round_robin_imbalance",
        "sorted_greedy_seconds_100k",
    }
    assert all(math.isfinite(value) and value > 0 for value in figures.values())
    cases = answer["details"]["cases"]
    assert {(c["num_sequences"], c["num_ranks"]) for c in cases} == {
        (10_000, 8),
        (10_000, 64),
        (100_000, 8),
        (100_000, 64),
    }
    assert all(c["bound"] <= c["karmarkar_karp"] <= c["round_robin"] for c in cases)
    assert figures["imbalance"] == max(c["karmarkar_karp"] for c in cases)
    calibration = answer["details"]["calibration"]
    assert calibration["b_over_a"] >= 0 and len(calibration["seconds"]) == 3


def test_calibration_fit_recovers_the_cost_model_and_drops_the_fixed_cost() -> None:
    a, b, fixed = 2e-5, 8e-9, 0.01
    seconds = {length: fixed + a * length + b * length**2 for length in (128, 512, 1024, 4096)}
    model = fit(seconds)
    assert model.per_token == 1.0
    assert model.per_token_pair == pytest.approx(b / a, rel=1e-6)
    # Noise that makes the quadratic term negative: attention taken as free.
    assert fit({128: 0.01, 256: 0.02, 512: 0.0399, 1024: 0.079}).per_token_pair == 0.0
