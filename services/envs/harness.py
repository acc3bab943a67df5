"""The agent harness: a token-in/token-out, multi-turn loop against inference.

The harness keeps token ids and never retokenizes history: a generation's ids are
appended as inference returned them, and only new text (tool output, the harness's own
messages) is tokenized — with special-token strings split, so text cannot forge the
conversation's structure. A context (segment) is laid out as

    <|system|>…<|end_of_turn|><|user|>instruction<|end_of_turn|><|assistant|>
    generation … <|end_of_turn|>
    <|tool|><|tool_result|>output<|/tool_result|><|end_of_turn|><|assistant|>
    generation … (until a final message, `finish`, or a budget)

When a context nears its limit the model is asked to summarize (``<|summarize|>``); the
next context starts from the task and that summary (the summary's own token ids).
Every segment keeps its token ids, behaviour logprobs, a mask of generated tokens, the
weight-version spans and the routed experts, stitched from its generation calls.

Routes are those of sampling time. Each call asks inference only for the rows the
segment does not hold yet (``routes_from``): a position's row is the routing of the
forward that first computed it -- for a generated token, the decode step that fed it
back; for a prompt or tool-output token, the prefill that first ran it (or, on a prefix
cache hit, the prefill that filled that cache block). Every call reuses only prefix-cache
blocks written under the rollout's first call's version (``cache_version``), so a later
turn attends to the KV its own earlier turns wrote even after a weight update: each
position is encoded, and routed, once, and the rows replayed are the ones every later
token attended to. A later call's recomputation of an earlier position (the unfinished
last cache block, or a block the cache evicted) is never kept. So the trainer replays,
for every generated token, the routes of the very forward that sampled it, under the
version whose logprob it recorded: the row of a trained token's input position comes
from the step that produced the token's behaviour logprob. Tool-output tokens are never
trained on, but later tokens attend to them: their rows are the next call's prefill's,
under the version serving that call. Across a weight update, the rows before it keep
the older version and the rows after it carry the newer one, as the version spans of
the tokens they sampled do.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from services import routed_experts
from services.api.v1 import common_pb2
from services.config.envs import HarnessConfig
from services.envs.tools import Tools, parse_tool_calls
from services.model_factory.vocabulary import special_token_ids

SYSTEM_PROMPT = (
    "You are a coding agent working in a repository. Use the tools to inspect files, write "
    "code and run tests; call finish when the task is done. Tools: read_file(path), "
    "write_file(path, content), edit(path, old, new), list_dir(path), run(command), "
    "run_tests(), todo(action, item), finish(message)."
)


@dataclass
class Generation:
    """What inference returned for one call."""

    token_ids: list[int]
    logprobs: list[float]
    version_spans: list[tuple[int, int, int]]
    # As inference packed it, checked to hold a row for every token but the last (of
    # prompt + generated) from prompt position ``routing_start``; None when inference
    # returned none.
    routing: common_pb2.RoutedExperts | None
    finish_reason: str
    routing_start: int = 0
    num_cached_tokens: int = 0  # prompt tokens inference served from its prefix cache


class GenerateFn(Protocol):
    """One inference call: routes from prompt position ``routes_from`` on, reusing only
    prefix-cache blocks written under ``cache_version`` (None: the serving version)."""

    async def __call__(
        self,
        prompt: list[int],
        max_tokens: int,
        stop: list[int],
        routes_from: int = 0,
        cache_version: int | None = None,
    ) -> Generation: ...


@dataclass
class SegmentBuilder:
    """One context as it grows."""

    token_ids: list[int]
    num_prompt_tokens: int
    kind: common_pb2.SegmentKind.ValueType = common_pb2.SEGMENT_KIND_MAIN
    logprobs: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    # Routed experts of positions 0.. num_routed - 1, one table per call, in order, as
    # inference packed them (checked, never decoded).
    route_tables: list[common_pb2.RoutedExperts] = field(default_factory=list)
    num_routed: int = 0
    routing_lost: bool = False  # a call came back without routing: the segment has none
    routing_bytes: int = 0  # routed-expert bytes received from inference

    def add_generated(self, generation: Generation) -> None:
        num_before = len(self.token_ids)
        offset = num_before - self.num_prompt_tokens
        self.spans += [(v, offset + s, offset + e) for v, s, e in generation.version_spans]
        self.token_ids += generation.token_ids
        self.logprobs += generation.logprobs
        self.generated += [1] * len(generation.token_ids)
        if generation.routing is None:
            self.routing_lost = True
            return
        # The call's rows start where this segment's end (it was asked for them from
        # num_routed): rows already held -- sampling time's -- are never replaced.
        assert generation.routing_start == self.num_routed, (
            generation.routing_start,
            self.num_routed,
        )
        self.routing_bytes += len(generation.routing.data)
        routed_experts.check(
            generation.routing, len(self.token_ids) - self.num_routed, "generation.routing"
        )
        self.route_tables.append(generation.routing)
        self.num_routed += generation.routing.shape[0]

    def routed_experts(self) -> common_pb2.RoutedExperts | None:
        """The stitched table (a row for every token but the last); None without routing."""
        if self.routing_lost or not self.route_tables:
            return None
        return routed_experts.join(self.route_tables, "generation.routing")

    def add_injected(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.generated += [0] * len(token_ids)

    def trim_injected_tail(self) -> None:
        """Drops tokens injected after the last generation: nothing was generated from
        them, so they carry no training signal (and no routing)."""
        while self.generated and not self.generated[-1]:
            self.token_ids.pop()
            self.logprobs.pop()
            self.generated.pop()

    def to_proto(self) -> common_pb2.Segment:
        segment = common_pb2.Segment(
            kind=self.kind,
            token_ids=self.token_ids,
            num_prompt_tokens=self.num_prompt_tokens,
            logprobs=self.logprobs,
            generated_mask=bytes(self.generated),
            version_spans=[
                common_pb2.VersionSpan(version=v, start=s, end=e) for v, s, e in _merge(self.spans)
            ],
        )
        routing = self.routed_experts()
        if routing is not None:
            # The last call ran every token but its own final one, so the stitched table
            # has a row for each token but the last (routed_experts.check).
            routed_experts.check(routing, len(self.token_ids), "segment.routed_experts")
            segment.routed_experts.CopyFrom(routing)
        return segment


def _merge(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    merged: list[tuple[int, int, int]] = []
    for version, start, end in spans:
        if merged and merged[-1][0] == version and merged[-1][2] == start:
            merged[-1] = (version, merged[-1][1], end)
        else:
            merged.append((version, start, end))
    return merged


@dataclass
class RolloutResult:
    """Everything a rollout produced before grading."""

    segments: list[common_pb2.Segment]
    stats: common_pb2.RolloutStats
    finish_reason: str
    min_version: int
    max_version: int


class Harness:
    """Runs one task to the end with a model (through `generate`) and the tools."""

    def __init__(self, generate: GenerateFn, tokenizer: Any, config: HarnessConfig) -> None:
        self.generate = generate
        self.tokenizer = tokenizer
        self.config = config
        self.special = special_token_ids()
        self._cache_version: int | None = None

    def _ids(self, *pieces: str) -> list[int]:
        """Special tokens by name, other text tokenized with special strings split."""
        ids: list[int] = []
        for piece in pieces:
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                ids += self.tokenizer.encode(
                    piece, add_special_tokens=False, split_special_tokens=True
                )
        return ids

    def prompt(self, instruction: str, summary_ids: list[int]) -> list[int]:
        """The token ids that open a context: system, the task, and a summary if any."""
        ids = self._ids("<|system|>", SYSTEM_PROMPT, "<|end_of_turn|>", "<|user|>", instruction)
        if summary_ids:
            ids += (
                self._ids("\nProgress so far:", "<|summary|>")
                + summary_ids
                + self._ids("<|/summary|>")
            )
        return ids + self._ids("<|end_of_turn|>", "<|assistant|>")

    def _keep_cache_version(self, generation: Generation) -> None:
        """The rollout's prefix-cache version: its first call's policy version, so its later
        turns reuse its own KV (and keep one routing per position) across weight updates."""
        if self._cache_version is None and generation.version_spans:
            self._cache_version = generation.version_spans[0][0]

    async def run(self, task: common_pb2.Task, tools: Tools) -> RolloutResult:
        """Generations and tool calls until a final message, `finish` or a budget."""
        self._cache_version = None
        config = self.config
        stop = [self.special["<|end_of_turn|>"], self.special["<|endoftext|>"]]
        segments: list[SegmentBuilder] = []
        segment = SegmentBuilder(self.prompt(task.instruction, []), 0)
        segment.num_prompt_tokens = len(segment.token_ids)
        stats = common_pb2.RolloutStats()
        generated_total = 0
        finish_reason = ""
        while not finish_reason:
            if stats.num_turns >= config.max_turns:
                finish_reason = "turn_budget"
                break
            if generated_total >= config.max_total_tokens:
                finish_reason = "token_budget"
                break
            room = config.context_tokens - len(segment.token_ids)
            if room < config.max_tokens_per_turn + config.max_tool_output_tokens + 16:
                if stats.num_summaries >= config.max_summaries:
                    finish_reason = "context_full"
                    break
                summary = await self._summarize(segment, stats, stop)
                segments.append(segment)
                generated_total += len(summary)
                segment = SegmentBuilder(self.prompt(task.instruction, summary), 0)
                segment.num_prompt_tokens = len(segment.token_ids)
                continue
            budget = min(
                config.max_tokens_per_turn, config.max_total_tokens - generated_total, room
            )
            generation = await self.generate(
                segment.token_ids, budget, stop, segment.num_routed, self._cache_version
            )
            self._keep_cache_version(generation)
            segment.add_generated(generation)
            generated_total += len(generation.token_ids)
            stats.num_turns += 1
            calls = self._account(generation.token_ids, stats)
            if not calls:
                if not config.require_finish:
                    finish_reason = "final_message"
                    break
                outputs = ["error: call a tool, or finish, to continue"]
            else:
                stats.num_tool_calls += len(calls)
                outputs = [await asyncio.to_thread(tools.call, call) for call in calls]
                if tools.state.finished:
                    finish_reason = "finished"
                    break
            self._inject_output(segment, generation, "\n".join(outputs), stats)
        segment.trim_injected_tail()
        if segment.generated:
            segments.append(segment)  # a context that never got a generation trains nothing
        versions = [v for s in segments for v, _, _ in s.spans]
        return RolloutResult(
            segments=[s.to_proto() for s in segments],
            stats=stats,
            finish_reason=finish_reason,
            min_version=min(versions, default=0),
            max_version=max(versions, default=0),
        )

    def _inject_output(
        self,
        segment: SegmentBuilder,
        generation: Generation,
        output: str,
        stats: common_pb2.RolloutStats,
    ) -> None:
        closing = (
            []
            if generation.token_ids[-1:] == [self.special["<|end_of_turn|>"]]
            else self._ids("<|end_of_turn|>")
        )
        body = self._ids(output)[: self.config.max_tool_output_tokens]
        stats.num_tool_output_tokens += len(body)
        segment.add_injected(
            closing
            + self._ids("<|tool|>", "<|tool_result|>")
            + body
            + self._ids("<|/tool_result|>", "<|end_of_turn|>", "<|assistant|>")
        )

    async def _summarize(
        self, segment: SegmentBuilder, stats: common_pb2.RolloutStats, stop: list[int]
    ) -> list[int]:
        """Asks for a summary at the end of `segment`; returns the summary's token ids."""
        request = self._ids(
            "<|user|>", "<|summarize|>", "<|end_of_turn|>", "<|assistant|>", "<|summary|>"
        )
        last = segment.token_ids[-1:]
        if (
            last
            and last[0] != self.special["<|end_of_turn|>"]
            and last[0] != self.special["<|assistant|>"]
        ):
            request = self._ids("<|end_of_turn|>") + request
        segment.add_injected(request)
        generation = await self.generate(
            segment.token_ids,
            self.config.summary_tokens,
            [*stop, self.special["<|/summary|>"]],
            segment.num_routed,
            self._cache_version,
        )
        self._keep_cache_version(generation)
        segment.add_generated(generation)
        segment.kind = common_pb2.SEGMENT_KIND_SUMMARY
        stats.num_summaries += 1
        stats.num_generated_tokens += len(generation.token_ids)
        closing = {self.special["<|/summary|>"], *stop}
        return [t for t in generation.token_ids if t not in closing]

    def _account(self, token_ids: list[int], stats: common_pb2.RolloutStats) -> list[Any]:
        """Counts thinking, tool-call and final-message tokens; returns the tool calls."""
        special = self.special
        state = "message"
        has_call = False
        message = 0
        for token in token_ids:
            if token == special["<|think|>"]:
                state = "think"
            elif token == special["<|tool_call|>"]:
                state, has_call = "call", True
            elif token in (special["<|/think|>"], special["<|/tool_call|>"]):
                state = "message"
            elif state == "think":
                stats.num_thinking_tokens += 1
            elif state == "call":
                stats.num_tool_call_tokens += 1
            elif token not in (special["<|end_of_turn|>"], special["<|endoftext|>"]):
                message += 1
        stats.num_generated_tokens += len(token_ids)
        if not has_call:
            stats.num_final_message_tokens += message
            return []
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return parse_tool_calls(text)
