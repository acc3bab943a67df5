"""Rewards of a rollout, by part: the task (tests), a concave length penalty, behaviour.

Length penalty (the report's form): ``C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q))`` with
``x`` a weighted sum of thinking tokens, tool-call tokens, tool-output tokens,
final-message tokens, tool calls and turns. C is increasing and concave for k > 0 and
0 < q < 1 (each extra unit of effort costs less than the one before), C(0) = 0, and
q -> 1 gives log(1 + k x) / k. The part added to the reward is ``-scale * C(x)``.

Behaviour penalties: to-do items left open when the agent stops; reasoning smuggled
into code comments (comment lines that read like thinking aloud, above a threshold);
and working only through the terminal (shell commands, never the file tools).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from services.api.v1 import common_pb2
from services.config.envs import LengthPenaltyConfig, RewardConfig

REASONING_WORDS = re.compile(
    r"\b(i think|let me|let's|we need to|i need to|i will|i'll|first,|then i|wait,|hmm|"
    r"actually,|maybe|i should|my approach|the idea is)\b",
    re.IGNORECASE,
)


def concave_cost(x: float, k: float, q: float) -> float:
    """C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)); increasing and concave for x >= 0."""
    if x < 0:
        raise ValueError(f"x must be >= 0, got {x}")
    return ((1 + k * x) ** (1 - q) - 1) / (k * (1 - q))


def effort(stats: common_pb2.RolloutStats, config: LengthPenaltyConfig) -> float:
    """x: the weighted sum of what the rollout spent."""
    return (
        config.thinking_tokens * stats.num_thinking_tokens
        + config.tool_call_tokens * stats.num_tool_call_tokens
        + config.tool_output_tokens * stats.num_tool_output_tokens
        + config.final_message_tokens * stats.num_final_message_tokens
        + config.tool_calls * stats.num_tool_calls
        + config.turns * stats.num_turns
    )


def reasoning_comment_lines(source: str) -> int:
    """Comment lines of Python source that read like thinking aloud."""
    count = 0
    for line in source.splitlines():
        comment = line.partition("#")[2] if "#" in line else ""
        if comment and (REASONING_WORDS.search(comment) or len(comment.split()) > 25):
            count += 1
    return count


@dataclass
class Behaviour:
    """What the behaviour penalties look at, gathered by the harness."""

    open_todos: int
    comment_reasoning_lines: int
    tool_names: list[str]


def reward(
    task_score: float,
    stats: common_pb2.RolloutStats,
    behaviour: Behaviour,
    config: RewardConfig,
) -> common_pb2.RewardParts:
    """The rollout's reward, by part."""
    length = -config.length.scale * concave_cost(
        effort(stats, config.length), config.length.k, config.length.q
    )
    rules = config.behaviour
    parts: dict[str, float] = {}
    if behaviour.open_todos:
        parts["unfinished_todos"] = -rules.unfinished_todo * behaviour.open_todos
    if behaviour.comment_reasoning_lines >= rules.comment_reasoning_lines:
        parts["comment_reasoning"] = -rules.comment_reasoning
    used = set(behaviour.tool_names) - {"finish", "todo", "<malformed>"}
    if used and used <= {"run"}:
        parts["terminal_only"] = -rules.terminal_only
    behaviour_total = math.fsum(parts.values())
    return common_pb2.RewardParts(
        task=task_score,
        length_penalty=length,
        behaviour=behaviour_total,
        behaviour_parts=parts,
        total=task_score + length + behaviour_total,
    )
