"""Checks of inference requests against the loaded model; failures name the field."""

from __future__ import annotations

import math

from services.api.v1 import inference_pb2
from services.wire.errors import require, require_identifier

MAX_STOP_TOKENS = 1024


def validate_generate(
    request: inference_pb2.GenerateRequest, *, vocab_size: int, max_model_len: int
) -> None:
    """Prompt ids inside the vocabulary, a budget that fits the context, sane sampling."""
    if request.request_id:
        require_identifier(request.request_id, "request_id")
    prompt = request.prompt_token_ids
    require(len(prompt) > 0, "prompt_token_ids", "must not be empty")
    bad = next((i for i, t in enumerate(prompt) if t >= vocab_size), None)
    require(
        bad is None,
        "prompt_token_ids",
        f"token id {prompt[bad] if bad is not None else 0} at position {bad} is outside "
        f"the vocabulary (size {vocab_size})",
    )
    require(
        request.routed_experts_from <= len(prompt),
        "routed_experts_from",
        f"{request.routed_experts_from} is beyond the prompt ({len(prompt)} tokens)",
    )
    require(request.HasField("sampling"), "sampling", "must be set")
    sampling = request.sampling
    require(sampling.max_tokens >= 1, "sampling.max_tokens", "must be >= 1")
    require(
        len(prompt) + sampling.max_tokens <= max_model_len,
        "sampling.max_tokens",
        f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
        f"context length {max_model_len}",
    )
    require(
        math.isfinite(sampling.temperature) and 0 <= sampling.temperature <= 100,
        "sampling.temperature",
        f"must be in [0, 100], got {sampling.temperature}",
    )
    require(0 <= sampling.top_p <= 1, "sampling.top_p", f"must be in [0, 1], got {sampling.top_p}")
    require(
        sampling.min_tokens <= sampling.max_tokens,
        "sampling.min_tokens",
        f"{sampling.min_tokens} exceeds max_tokens ({sampling.max_tokens})",
    )
    require(
        sampling.top_k <= vocab_size,
        "sampling.top_k",
        f"{sampling.top_k} exceeds the vocabulary (size {vocab_size})",
    )
    require(
        len(sampling.stop_token_ids) <= MAX_STOP_TOKENS,
        "sampling.stop_token_ids",
        f"{len(sampling.stop_token_ids)} ids; at most {MAX_STOP_TOKENS}",
    )
    for index, token in enumerate(sampling.stop_token_ids):
        require(
            token < vocab_size,
            f"sampling.stop_token_ids[{index}]",
            f"{token} is outside the vocabulary (size {vocab_size})",
        )
