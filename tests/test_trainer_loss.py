"""The RL objective on small cases computed by hand, and what it trains on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.api.v1 import common_pb2, reconciler_pb2
from services.objectstore.base import sha256_hex
from services.objectstore.local import FileObjectStore
from services.trainer.batch import (
    PulledGroup,
    build_rl_batch,
    dr_grpo_advantages,
    load_groups,
    returned_slots,
)
from services.trainer.loss import next_token_loss, policy_loss
from services.trainer.model import Architecture, PackedInputs
from services.trainer.rollouts import Rollout, RolloutError, parse_record, parse_segment

ARCH = Architecture(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=8,
    max_position_embeddings=64,
)


def test_advantages_are_reward_minus_group_mean_without_std_division() -> None:
    # Mean 0.25; a std-normalized GRPO would give [1.73, -0.58, -0.58, -0.58].
    assert dr_grpo_advantages([1.0, 0.0, 0.0, 0.0]) == [0.75, -0.25, -0.25, -0.25]
    assert dr_grpo_advantages([2.0, 2.0]) == [0.0, 0.0]


def _loss(**overrides: object) -> tuple[torch.Tensor, object]:
    arguments: dict[str, object] = {
        "logprobs": torch.tensor([-1.0, -2.0, -0.5, -1.5], requires_grad=True),
        "behaviour_logprobs": torch.tensor([-1.0, -2.0, -0.5, -1.5]),
        # Rollout a: three tokens, A = +0.5. Rollout b: one token, A = -0.5.
        "advantages": torch.tensor([0.5, 0.5, 0.5, -0.5]),
        "weights": torch.ones(4),
        "normalizer": 2 * 10.0,  # two rollouts, a generation budget of 10 tokens
        "importance_cap": 2.0,
    }
    arguments.update(overrides)
    logprobs = arguments["logprobs"]
    assert isinstance(logprobs, torch.Tensor)
    result = policy_loss(**arguments)  # type: ignore[arg-type]
    result.loss.backward()
    assert logprobs.grad is not None
    return logprobs.grad, result


def test_token_sums_are_divided_by_a_constant_not_by_each_rollouts_length() -> None:
    grad, result = _loss()
    # -(3 * 0.5 + 1 * -0.5) / 20: the long rollout counts three times, the short one once.
    assert result.loss.item() == pytest.approx(-0.05)
    # Every token's gradient is -A / (N * B), whatever its rollout's length.
    assert grad.tolist() == pytest.approx([-0.025, -0.025, -0.025, 0.025])


def test_the_importance_ratio_is_truncated_at_c() -> None:
    behaviour = torch.tensor([-1.0 - math.log(3.0), -2.0 + math.log(2.0), -0.5, -1.5])
    grad, result = _loss(behaviour_logprobs=behaviour)
    # Ratios 3 (truncated to 2), 0.5, 1, 1.
    assert result.importance_ratio.tolist() == pytest.approx([3.0, 0.5, 1.0, 1.0])
    assert result.clipped.tolist() == [True, False, False, False]
    assert grad.tolist() == pytest.approx([-0.05, -0.0125, -0.025, 0.025])
    assert result.loss.item() == pytest.approx(-(2 * 0.5 + 0.5 * 0.5 + 0.5 - 0.5) / 20)


def test_kl_is_the_k1_estimator_as_a_per_token_penalty() -> None:
    reference = torch.tensor([-1.5, -2.0, -0.25, -1.5])
    grad, result = _loss(advantages=torch.zeros(4), kl_coef=0.1, reference_logprobs=reference)
    # k1 = log pi - log pi_ref = [0.5, 0, -0.25, 0]; k3 (r - 1 - log r) would be
    # [0.107, 0, 0.034, 0] and never negative.
    assert result.k1.tolist() == pytest.approx([0.5, 0.0, -0.25, 0.0])
    assert result.kl_penalty.item() == pytest.approx(0.1 * (0.5 - 0.25) / 20)
    assert grad.tolist() == pytest.approx([0.1 * 0.5 / 20, 0.0, 0.1 * -0.25 / 20, 0.0])


def test_the_kl_needs_a_reference_and_the_normalizer_must_be_positive() -> None:
    with pytest.raises(ValueError, match="reference_logprobs"):
        _loss(kl_coef=0.1)
    with pytest.raises(ValueError, match="normalizer"):
        _loss(normalizer=0.0)
    assert next_token_loss(torch.tensor([-1.0, -3.0]), 2).item() == 2.0


def _segment(
    tokens: list[int], num_prompt: int, mask: list[int], logprobs: list[float] | None = None
) -> common_pb2.Segment:
    routes = torch.zeros(len(tokens), ARCH.num_layers, ARCH.top_k, dtype=torch.uint8)
    routes[:, :, 1] = 1
    return common_pb2.Segment(
        token_ids=tokens,
        num_prompt_tokens=num_prompt,
        logprobs=logprobs if logprobs is not None else [-0.5 if m else 0.0 for m in mask],
        generated_mask=bytes(mask),
        routed_experts=common_pb2.RoutedExperts(
            data=routes.numpy().tobytes(), shape=list(routes.shape), dtype=1
        ),
    )


def test_tool_output_and_prompt_tokens_are_context_but_never_trained() -> None:
    # Prompt [5, 6, 7], then generated 8, 9, tool output 10, 11, generated 12.
    segment = parse_segment(
        _segment([5, 6, 7, 8, 9, 10, 11, 12], 3, [1, 1, 0, 0, 1]), ARCH, use_replay=True
    )
    assert segment is not None
    assert segment.input_ids == [5, 6, 7, 8, 9, 10, 11]
    assert segment.targets == [6, 7, 8, 9, 10, 11, 12]
    assert segment.trained == [False, False, True, True, False, False, True]
    assert segment.behaviour_logprobs == [0, 0, -0.5, -0.5, 0, 0, -0.5]
    assert segment.replay is not None and segment.replay.shape == (7, 2, 2)


def _record(segments: list[common_pb2.Segment]) -> common_pb2.RolloutRecord:
    return common_pb2.RolloutRecord(
        summary=common_pb2.RolloutSummary(rollout_id="r"), segments=segments
    )


def _summary(reward: float, index: int) -> common_pb2.RolloutSummary:
    return common_pb2.RolloutSummary(
        rollout_id=f"r{index}", sample_index=index, reward=common_pb2.RewardParts(total=reward)
    )


def test_every_segment_of_a_rollout_gets_its_final_reward() -> None:
    # Rollout 0 self-summarized: a main context, a summary generation, a continuation.
    summarized = parse_record(
        _record(
            [
                _segment([1, 2, 3, 4], 2, [1, 1]),
                _segment([1, 2, 13, 14, 15], 2, [1, 1, 1]),
                _segment([13, 14, 15, 20, 21], 3, [1, 1]),
            ]
        ),
        1.0,
        ARCH,
        replay_mode="when_present",
    )
    plain = parse_record(_record([_segment([1, 2, 3], 2, [1])]), 0.0, ARCH, replay_mode="off")
    batch = build_rl_batch(
        [PulledGroup("g", 1.0, [_summary(1.0, 0), _summary(0.0, 1)], [summarized, plain])],
        microbatch_tokens=1000,
        num_layers=2,
        top_k=2,
    )
    (microbatch,) = batch.microbatches
    trained_advantages = microbatch.advantages[microbatch.trained]
    # Seven generated tokens of rollout 0 (2 + 3 + 2) at +0.5, one of rollout 1 at -0.5.
    assert trained_advantages.tolist() == [0.5] * 7 + [-0.5]
    assert batch.num_rollouts == 2
    assert microbatch.inputs.cu_seqlens == [0, 3, 7, 11, 13]
    # Rollout 1 was parsed with replay off: its tokens route by the router.
    assert microbatch.inputs.replay_mask is not None
    assert microbatch.inputs.replay_mask.tolist() == [True] * 11 + [False] * 2


@pytest.mark.parametrize(
    ("segment", "reason"),
    [
        (_segment([1, 2, 3], 1, [1, 1], logprobs=[]), "logprobs_missing"),
        (_segment([1, 2, 3], 1, [1, 1], logprobs=[-0.1]), "logprobs_length"),
        (_segment([1, 2, 3], 1, [1, 1], logprobs=[-0.1, float("nan")]), "logprobs_invalid"),
        (_segment([1, 2, 3], 1, [1]), "mask_length"),
        (_segment([1, 2, 99], 1, [1, 1]), "token_range"),
    ],
)
def test_bad_records_are_refused_with_a_reason(segment: common_pb2.Segment, reason: str) -> None:
    with pytest.raises(RolloutError) as error:
        parse_record(_record([segment]), 1.0, ARCH, replay_mode="when_present")
    assert error.value.reason == reason


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ([3, 2, 3], "routed_experts_shape"),  # wrong top_k
        ([3, 3, 2], "routed_experts_layers"),  # wrong layer count
        ([1, 2, 2], "routed_experts_shape"),  # wrong token count
    ],
)
def test_routed_experts_of_the_wrong_shape_are_refused(shape: list[int], reason: str) -> None:
    segment = _segment([1, 2, 3], 1, [1, 1])
    segment.routed_experts.CopyFrom(
        common_pb2.RoutedExperts(data=bytes(math.prod(shape)), shape=shape, dtype=1)
    )
    with pytest.raises(RolloutError) as error:
        parse_record(_record([segment]), 1.0, ARCH, replay_mode="when_present")
    assert error.value.reason == reason
    segment.routed_experts.CopyFrom(
        common_pb2.RoutedExperts(data=bytes([9] * 12), shape=[3, 2, 2], dtype=1)
    )
    with pytest.raises(RolloutError, match="routed_experts_range"):
        parse_record(_record([segment]), 1.0, ARCH, replay_mode="when_present")


def test_routed_experts_may_leave_out_the_last_token_which_is_never_an_input() -> None:
    segment = _segment([1, 2, 3], 1, [1, 1])
    full = parse_segment(segment, ARCH, use_replay=True)
    routes = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 0]]], dtype=torch.uint8)
    segment.routed_experts.CopyFrom(
        common_pb2.RoutedExperts(data=routes.numpy().tobytes(), shape=[2, 2, 2], dtype=1)
    )
    short = parse_segment(segment, ARCH, use_replay=True)
    assert full is not None and short is not None
    assert full.replay is not None and short.replay is not None
    assert short.replay.tolist() == routes.long().tolist()
    assert full.replay.shape == short.replay.shape == (2, 2, 2)


def test_tokens_inference_never_ran_have_no_routes_and_use_the_router() -> None:
    # As the envs harness writes it: int16 rows, -1 for tool output injected after the
    # last generation (never run by inference) and for the final token.
    segment = _segment([1, 2, 3, 4, 5], 1, [1, 1, 0, 0])
    routes = torch.tensor(
        [[[0, 1]] * 2, [[2, 3]] * 2, [[-1, -1]] * 2, [[-1, -1]] * 2, [[-1, -1]] * 2]
    )
    segment.routed_experts.CopyFrom(
        common_pb2.RoutedExperts(
            data=routes.to(torch.int16).numpy().tobytes(),
            shape=[5, 2, 2],
            dtype=common_pb2.INDEX_DTYPE_INT16,
        )
    )
    parsed = parse_segment(segment, ARCH, use_replay=True)
    assert parsed is not None and parsed.replay is not None
    packed = PackedInputs.pack([parsed.input_ids], [parsed.replay], num_layers=2, top_k=2)
    assert packed.replay_mask is not None
    assert packed.replay_mask.tolist() == [True, True, False, False]
    assert packed.replay_experts is not None and int(packed.replay_experts.min()) == 0
    routes[1, 0, 1] = -1  # half a row recorded is not a record of anything
    segment.routed_experts.data = routes.to(torch.int16).numpy().tobytes()
    with pytest.raises(RolloutError, match="some entries but not all"):
        parse_segment(segment, ARCH, use_replay=True)


def test_single_sample_groups_and_bad_rollouts_are_skipped_and_counted() -> None:
    good = parse_record(_record([_segment([1, 2, 3], 2, [1])]), 1.0, ARCH, replay_mode="off")
    assert isinstance(good, Rollout)
    bad = RolloutError("routed_experts_layers", "3 MoE layers, the model has 2")
    gone = RolloutError("store_unavailable", "connection refused", retryable=True)
    groups = [
        PulledGroup("k1", 1.0, [_summary(1.0, 0)], [good]),
        PulledGroup("mixed", 0.5, [_summary(1.0, 0), _summary(0.0, 1)], [good, bad]),
        PulledGroup("unserved", 1.0, [_summary(1.0, 0), _summary(0.0, 1)], [gone, good]),
        PulledGroup("fine", 0.5, [_summary(1.0, 0), _summary(0.0, 1)], [good, good]),
    ]
    batch = build_rl_batch(groups, microbatch_tokens=1000, num_layers=2, top_k=2)
    # A group with a record that failed is handed back whole, its rewards not counted (it
    # comes again, or is dropped); the others train.
    assert batch.skipped == {
        "group_single_sample": 1,
        "group_returned": 2,
        "rollout_routed_experts_layers": 1,
        "rollout_store_unavailable": 1,
    }
    assert batch.advantages == [0.5, -0.5]
    assert [r.total for r in batch.rewards] == [1.0, 0.0]
    assert batch.group_weights == [0.5, 0.5]
    assert batch.microbatches[0].weights.tolist() == [0.5] * 4
    assert [(s.slot_id, s.reason, s.retryable) for s in returned_slots(groups)] == [
        ("mixed/1", "trainer: routed_experts_layers", False),
        ("unserved/0", "trainer: store_unavailable", True),
    ]


def _graded(task: float, length_penalty: float, index: int) -> common_pb2.RolloutSummary:
    reward = common_pb2.RewardParts(
        total=task + length_penalty, task=task, length_penalty=length_penalty
    )
    return common_pb2.RolloutSummary(rollout_id=f"r{index}", sample_index=index, reward=reward)


@pytest.mark.parametrize("skip", [False, True])
def test_groups_whose_task_rewards_are_all_equal_may_be_left_out(skip: bool) -> None:
    rollout = parse_record(_record([_segment([1, 2, 3], 2, [1])]), 1.0, ARCH, replay_mode="off")
    assert isinstance(rollout, Rollout)
    # All failed, the length penalty alone telling them apart; all solved; mixed.
    failed = [_graded(0.0, -0.1, 0), _graded(0.0, -0.3, 1)]
    solved = [_graded(1.0, -0.1, 0), _graded(1.0, -0.1, 1)]
    mixed = [_graded(1.0, -0.2, 0), _graded(0.0, -0.2, 1)]
    batch = build_rl_batch(
        [
            PulledGroup("failed", 1.0, failed, [rollout, rollout]),
            PulledGroup("solved", 1.0, solved, [rollout, rollout]),
            PulledGroup("mixed", 1.0, mixed, [rollout, rollout]),
        ],
        microbatch_tokens=1000,
        num_layers=2,
        top_k=2,
        skip_uniform_task_groups=skip,
    )
    # What the policy sampled is reported either way: six rollouts' rewards.
    assert [r.task for r in batch.rewards] == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert batch.uniform_task_groups == 2
    if skip:
        assert batch.skipped == {"group_uniform_task_reward": 2}
        assert batch.num_rollouts == 2
        assert batch.advantages == pytest.approx([0.5, -0.5])
        assert len(batch.microbatches[0].inputs.cu_seqlens) == 3  # two sequences
    else:
        assert not batch.skipped
        assert batch.num_rollouts == 6
        assert batch.advantages == pytest.approx([0.1, -0.1, 0.0, 0.0, 0.5, -0.5])


class _CountingStore(FileObjectStore):
    """A file store that remembers which keys were read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.read: list[str] = []

    def get(self, key: str) -> bytes:
        self.read.append(key)
        return super().get(key)


@pytest.mark.parametrize("skip", [False, True])
def test_a_left_out_group_is_decided_from_its_summaries_without_fetching(
    tmp_path: Path, skip: bool
) -> None:
    store = _CountingStore(tmp_path)
    data = _record([_segment([1, 2, 3], 2, [1])]).SerializeToString()

    def graded(group: str, task: float, index: int) -> common_pb2.RolloutSummary:
        summary = _graded(task, -0.1 * index, index)
        key = f"rollouts/{group}/{index}.pb"
        store.put(key, data)
        summary.record.CopyFrom(
            common_pb2.ObjectRef(key=key, size_bytes=len(data), sha256=sha256_hex(data))
        )
        return summary

    groups = [
        reconciler_pb2.Group(
            group_id="failed", rollouts=[graded("failed", 0.0, i) for i in (0, 1)]
        ),
        reconciler_pb2.Group(
            group_id="mixed", rollouts=[graded("mixed", float(i), i) for i in (0, 1)]
        ),
        reconciler_pb2.Group(group_id="single", rollouts=[graded("single", 1.0, 0)]),
    ]
    pulled = load_groups(store, groups, ARCH, "off", skip_uniform_task_groups=skip)
    fetched = {key.split("/")[1] for key in store.read}
    assert fetched == ({"mixed"} if skip else {"failed", "mixed"})
    assert [len(group.rollouts) for group in pulled] == [0 if skip else 2, 2, 0]
    batch = build_rl_batch(
        pulled, microbatch_tokens=1000, num_layers=2, top_k=2, skip_uniform_task_groups=skip
    )
    # The same step as with every record fetched: only the counts tell the groups apart.
    assert batch.skipped == (
        {"group_single_sample": 1, "group_uniform_task_reward": 1}
        if skip
        else {"group_single_sample": 1}
    )
    assert batch.num_rollouts == (2 if skip else 4)
    assert [r.task for r in batch.rewards] == [0.0, 0.0, 0.0, 1.0]


def test_a_step_of_only_uniform_groups_trains_nothing() -> None:
    rollout = parse_record(_record([_segment([1, 2, 3], 2, [1])]), 1.0, ARCH, replay_mode="off")
    batch = build_rl_batch(
        [PulledGroup("failed", 1.0, [_graded(0.0, 0.0, 0), _graded(0.0, -0.1, 1)], [rollout] * 2)],
        microbatch_tokens=1000,
        num_layers=2,
        top_k=2,
        skip_uniform_task_groups=True,
    )
    assert batch.microbatches == [] and batch.num_rollouts == 0 and batch.num_trained_tokens == 0
