"""Rollout records from the object store, checked and turned into trainable token streams.

A ``RolloutRecord`` holds one or more segments (a main context, and with
self-summarization the generation that wrote a summary and the context that continued
from it). Each segment becomes one packed sequence: inputs ``token_ids[:-1]``, targets
``token_ids[1:]``; a target is trained when the policy generated it (after the prompt,
``generated_mask`` 1), never when it is prompt or injected tool output. Its behaviour
logprob comes from ``Segment.logprobs``; its replayed routing is the routed-expert row
of its *input* token, which is the token whose forward pass inference routed (the
segment's last token is never an input, so its row may be absent); its generating version
comes from the segment's version spans (``services.trainer.offpolicy``). Envs stitches the
rows from sampling time (``services.envs.harness``): a row is the routing of the forward
that first computed its position, so a trained token's input row comes from the very
step that produced its behaviour logprob, under the same policy version, even in a
rollout that spans turns and weight updates.

A record that does not fit (routed experts of the wrong shape, dtype or layer count,
logprobs missing or not finite, masks of the wrong length, version spans beyond its
tokens, unknown token ids, too long for the model) raises ``RolloutError`` with a short
``reason``; so does a record that is missing or corrupt, or that the object store did not
serve (``retryable``: it may load later). The trainer hands the rollout's group back to
the reconciler, which runs the slot again or marks it dead with the reason, and trains
on; it never crashes mid-run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services import routed_experts
from services.api.v1 import common_pb2
from services.objectstore.base import (
    InvalidObjectKey,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    sha256_hex,
)
from services.trainer.model.architecture import Architecture


class RolloutError(ValueError):
    """A rollout the trainer cannot train on; ``reason`` labels the skip metric, and
    ``retryable`` says the record may load later (the store did not answer)."""

    def __init__(self, reason: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.retryable = retryable


@dataclass
class SegmentTokens:
    """One segment as a trainable sequence (all lists of length len(token_ids) - 1)."""

    input_ids: list[int]
    targets: list[int]
    trained: list[bool]
    behaviour_logprobs: list[float]
    replay: torch.Tensor | None  # [len(input_ids), layers, k] int64 (-1: none), or None
    # The policy version that generated each target, from the segment's version spans
    # (-1: not generated, or no span covers it); None: no versions known (not a rollout).
    generating_versions: list[int] | None = None


@dataclass
class Rollout:
    """A checked rollout: its segments and the summary fields the loss needs."""

    rollout_id: str
    reward: float
    segments: list[SegmentTokens]

    @property
    def num_trained_tokens(self) -> int:
        """Generated tokens over all segments."""
        return sum(sum(segment.trained) for segment in self.segments)


def decode_routed_experts(
    routed: common_pb2.RoutedExperts, num_tokens: int, arch: Architecture
) -> torch.Tensor | None:
    """``[rows, layers, k]`` int64 from the packed message (rows: ``num_tokens``, or one
    fewer when the last token's row is left out); None when the message is empty.

    A row of -1 means inference never ran that token (the last one, or tool output
    injected after the last generation): the trainer's router decides for it.
    """
    try:
        indices = routed_experts.decode(routed, num_tokens)
    except routed_experts.RoutedExpertsError as error:
        raise RolloutError(error.reason, str(error)) from None
    if indices is None:
        return None
    shape = indices.shape
    if shape[2] != arch.top_k:
        raise RolloutError(
            "routed_experts_shape", f"shape {shape}, expected [tokens, layers, {arch.top_k}]"
        )
    if shape[1] != arch.num_layers:
        raise RolloutError(
            "routed_experts_layers", f"{shape[1]} MoE layers, the model has {arch.num_layers}"
        )
    if indices.size and (indices.min() < -1 or indices.max() >= arch.num_experts):
        raise RolloutError(
            "routed_experts_range", f"expert ids outside [0, {arch.num_experts}) (or -1)"
        )
    missing = (indices == -1).reshape(shape[0], -1)
    if (missing.any(axis=1) & ~missing.all(axis=1)).any():
        raise RolloutError(
            "routed_experts_range", "a token has -1 (no routing) in some entries but not all"
        )
    return torch.from_numpy(indices)


def parse_segment(
    segment: common_pb2.Segment, arch: Architecture, *, use_replay: bool
) -> SegmentTokens | None:
    """A segment as a trainable sequence; None when it has no token after its prompt."""
    tokens = list(segment.token_ids)
    num_prompt = segment.num_prompt_tokens
    num_after = len(tokens) - num_prompt
    if num_prompt < 1 or num_after < 0:
        raise RolloutError(
            "prompt_length", f"num_prompt_tokens {num_prompt} for {len(tokens)} tokens"
        )
    if num_after == 0:
        return None
    if len(tokens) > arch.max_position_embeddings:
        raise RolloutError(
            "too_long",
            f"{len(tokens)} tokens > max_position_embeddings {arch.max_position_embeddings}",
        )
    if max(tokens) >= arch.vocab_size:
        raise RolloutError("token_range", f"token id {max(tokens)} >= vocab {arch.vocab_size}")
    if len(segment.generated_mask) != num_after:
        raise RolloutError(
            "mask_length", f"{len(segment.generated_mask)} mask bytes for {num_after} tokens"
        )
    generated = [byte != 0 for byte in segment.generated_mask]
    if not segment.logprobs and any(generated):
        raise RolloutError("logprobs_missing", "the segment has no behaviour logprobs")
    if len(segment.logprobs) != num_after:
        raise RolloutError(
            "logprobs_length", f"{len(segment.logprobs)} logprobs for {num_after} tokens"
        )
    logprobs = list(segment.logprobs)
    if any(
        not math.isfinite(lp) or lp > 1e-3 for lp, g in zip(logprobs, generated, strict=True) if g
    ):
        raise RolloutError("logprobs_invalid", "a generated token's logprob is not finite or > 0")
    routes = (
        decode_routed_experts(segment.routed_experts, len(tokens), arch) if use_replay else None
    )
    versions = generating_versions(segment.version_spans, num_after)
    # Target j is token j + 1; it is trained when that token was generated by the policy.
    trained = [False] * (num_prompt - 1) + generated
    behaviour = [0.0] * (num_prompt - 1) + [
        lp if g else 0.0 for lp, g in zip(logprobs, generated, strict=True)
    ]
    return SegmentTokens(
        input_ids=tokens[:-1],
        targets=tokens[1:],
        trained=trained,
        behaviour_logprobs=behaviour,
        replay=None if routes is None else routes[: len(tokens) - 1],
        generating_versions=[-1] * (num_prompt - 1)
        + [v if g else -1 for v, g in zip(versions, generated, strict=True)],
    )


def generating_versions(spans: Sequence[common_pb2.VersionSpan], num_after: int) -> list[int]:
    """The version of each of the ``num_after`` tokens after the prompt (-1 where no span
    covers it); a span outside those tokens raises ``RolloutError``."""
    versions = [-1] * num_after
    for span in spans:
        if not span.start <= span.end <= num_after:
            raise RolloutError(
                "version_spans",
                f"span [{span.start}, {span.end}) of version {span.version} is outside the "
                f"{num_after} tokens after the prompt",
            )
        versions[span.start : span.end] = [span.version] * (span.end - span.start)
    return versions


def parse_record(
    record: common_pb2.RolloutRecord, reward: float, arch: Architecture, *, replay_mode: str
) -> Rollout:
    """A checked ``Rollout``; raises ``RolloutError`` when any segment does not fit."""
    segments = []
    for segment in record.segments:
        parsed = parse_segment(segment, arch, use_replay=replay_mode != "off")
        if parsed is None:
            continue
        if replay_mode == "required" and parsed.replay is None:
            raise RolloutError("routed_experts_missing", "replay is required and absent")
        segments.append(parsed)
    if not segments:
        raise RolloutError("no_generated_tokens", "no segment has tokens after its prompt")
    return Rollout(record.summary.rollout_id, reward, segments)


def fetch_record(store: ObjectStore, ref: common_pb2.ObjectRef) -> common_pb2.RolloutRecord:
    """Downloads and verifies (size, SHA-256) a rollout record."""
    if not ref.key:
        raise RolloutError("record_missing", "the rollout summary has no record reference")
    try:
        data = store.get(ref.key)
    except InvalidObjectKey as error:
        raise RolloutError("record_corrupt", str(error)) from None
    except ObjectNotFound as error:
        raise RolloutError("record_missing", str(error)) from None
    except (ObjectStoreError, OSError) as error:
        # The store did not serve it (after its own retries): the record may be intact.
        raise RolloutError("store_unavailable", str(error), retryable=True) from None
    if (ref.size_bytes and len(data) != ref.size_bytes) or (
        ref.sha256 and sha256_hex(data) != ref.sha256
    ):
        raise RolloutError("record_corrupt", f"{ref.key}: size or SHA-256 does not match")
    record = common_pb2.RolloutRecord()
    try:
        record.ParseFromString(data)
    except Exception as error:  # protobuf raises DecodeError; any failure means corrupt data
        raise RolloutError("record_corrupt", f"{ref.key}: {error}") from None
    return record
