"""Rewards by part, against hand-computed values."""

from __future__ import annotations

import itertools
import math

import pytest

from services.api.v1 import common_pb2
from services.config.envs import BehaviourConfig, LengthPenaltyConfig, RewardConfig
from services.envs.rewards import (
    Behaviour,
    concave_cost,
    effort,
    reasoning_comment_lines,
    reward,
)
from services.envs.tools import parse_tool_calls


def test_concave_cost_hand_computed() -> None:
    # k = 0.5, q = 0.5: C(x) = ((1 + x/2)^0.5 - 1) / 0.25
    assert concave_cost(0, 0.5, 0.5) == 0
    assert concave_cost(6, 0.5, 0.5) == pytest.approx((2.0 - 1) / 0.25)  # (1 + 3)^0.5 = 2
    assert concave_cost(16, 0.5, 0.5) == pytest.approx((3.0 - 1) / 0.25)  # (1 + 8)^0.5 = 3
    # q -> 1 approaches log(1 + k x) / k
    assert concave_cost(10, 0.1, 0.999999) == pytest.approx(math.log(2) / 0.1, rel=1e-4)
    with pytest.raises(ValueError, match="x must be >= 0"):
        concave_cost(-1, 0.5, 0.5)


@pytest.mark.parametrize(("k", "q"), [(0.01, 0.5), (0.1, 0.2), (1.0, 0.9)])
def test_concave_cost_is_increasing_and_concave(k: float, q: float) -> None:
    values = [concave_cost(x, k, q) for x in range(0, 2000, 10)]
    steps = [b - a for a, b in itertools.pairwise(values)]
    assert all(step > 0 for step in steps)  # increasing
    assert all(later <= earlier + 1e-12 for earlier, later in itertools.pairwise(steps))  # concave


def test_effort_and_total_reward_hand_computed() -> None:
    stats = common_pb2.RolloutStats(
        num_thinking_tokens=10,
        num_tool_call_tokens=20,
        num_tool_output_tokens=100,
        num_final_message_tokens=5,
        num_tool_calls=2,
        num_turns=3,
    )
    length = LengthPenaltyConfig(
        scale=0.1,
        k=0.5,
        q=0.5,
        thinking_tokens=1,
        tool_call_tokens=1,
        tool_output_tokens=0.1,
        final_message_tokens=1,
        tool_calls=1,
        turns=1,
    )
    # x = 10 + 20 + 0.1 * 100 + 5 + 2 + 3 = 50;  C(50) = ((1 + 25)^0.5 - 1) / 0.25
    assert effort(stats, length) == pytest.approx(50)
    expected_length = -0.1 * (math.sqrt(26) - 1) / 0.25
    config = RewardConfig(
        length=length, behaviour=BehaviourConfig(unfinished_todo=0.1, terminal_only=0.3)
    )
    parts = reward(
        1.0,
        stats,
        Behaviour(open_todos=2, comment_reasoning_lines=0, tool_names=["run", "run"]),
        config,
    )
    assert parts.task == 1.0
    assert parts.length_penalty == pytest.approx(expected_length)
    assert dict(parts.behaviour_parts) == pytest.approx(
        {"unfinished_todos": -0.2, "terminal_only": -0.3}
    )
    assert parts.behaviour == pytest.approx(-0.5)
    assert parts.total == pytest.approx(1.0 + expected_length - 0.5)


def test_behaviour_penalties_fire_only_when_they_should() -> None:
    stats = common_pb2.RolloutStats()
    config = RewardConfig(length=LengthPenaltyConfig(scale=0))
    clean = reward(
        0.5, stats, Behaviour(0, 0, ["read_file", "write_file", "run", "finish"]), config
    )
    assert dict(clean.behaviour_parts) == {} and clean.total == 0.5
    smuggled = reward(0.5, stats, Behaviour(0, 3, ["write_file"]), config)
    assert dict(smuggled.behaviour_parts) == pytest.approx({"comment_reasoning": -0.2})


def test_reasoning_comments_are_detected() -> None:
    honest = "def f(x):\n    # clamp to the valid range\n    return max(0, x)\n"
    smuggled = (
        "def f(x):\n"
        "    # I think we need to handle negatives first, let me check the spec\n"
        "    # Hmm, actually maybe the tests want zero here\n"
        "    return max(0, x)  # wait, I should double check this later\n"
    )
    assert reasoning_comment_lines(honest) == 0
    assert reasoning_comment_lines(smuggled) == 3


def test_tool_call_grammar() -> None:
    text = (
        '<|think|>plan<|/think|><|tool_call|>{"name": "write_file", "arguments": {"path": "a.py", '
        '"content": "x = 1"}}<|/tool_call|> and <|tool_call|>{"name": run}<|/tool_call|>'
        '<|tool_call|>["x"]<|/tool_call|><|tool_call|>{"name": "finish", "arguments": {}'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.error == "") for c in calls] == [
        ("write_file", True),
        ("", False),
        ("", False),
        ("", False),
    ]
    assert calls[0].arguments == {"path": "a.py", "content": "x = 1"}
    assert "not valid JSON" in calls[1].error and "must be" in calls[2].error
