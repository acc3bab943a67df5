"""The harness's view of inference: one Generate call, token ids in and out."""

from __future__ import annotations

import logging
import zlib

import grpc
from grpc import aio

from services import routed_experts
from services.api.v1 import inference_pb2, inference_pb2_grpc
from services.envs.harness import Generation
from services.wire.retry import RetryPolicy, retrying

log = logging.getLogger(__name__)

GIVEN_UP_BY_THE_REPLICA = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class InferenceGenerator:
    """Calls InferenceService.Generate with the rollout's sampling settings.

    A replica that is UNAVAILABLE (restarting, still loading, gone mid-stream) is waited
    for, with backoff (0.25 s doubling to 5 s), up to ``unavailable_wait_s``; the call then
    starts over (tokens of a broken stream are dropped). Counting such a fault as a failed
    rollout attempt would burn the slot's attempts in a second while a replica restarts;
    the channel's own retry policy cannot wait that long (``services.wire.retry``).

    CANCELLED is such a fault too: a cancel of this side's own ends the call with
    asyncio.CancelledError, so a CANCELLED status comes from the replica, which gave the
    call up while shutting down (gRPC cancels what is left when its stop grace ends, or a
    call that reached a replica as it closed) without handing it back UNAVAILABLE.
    """

    def __init__(
        self,
        channel: aio.Channel,
        temperature: float,
        seed: int | None,
        unavailable_wait_s: float = 300.0,
    ) -> None:
        self.stub = inference_pb2_grpc.InferenceServiceStub(channel)
        self.temperature = temperature
        self.seed = seed
        self.retry = RetryPolicy(
            codes=GIVEN_UP_BY_THE_REPLICA,
            initial_backoff_s=0.25,
            max_backoff_s=5.0,
            deadline_s=unavailable_wait_s,
        )
        self.calls = 0

    async def __call__(
        self,
        prompt: list[int],
        max_tokens: int,
        stop: list[int],
        routes_from: int = 0,
        cache_version: int | None = None,
    ) -> Generation:
        """One generation; its routing starts at prompt position ``routes_from`` (the
        caller holds the rows before it); it reuses prefix-cache blocks written under
        ``cache_version`` (the rollout's first call's version; None: the serving one)."""
        self.calls += 1
        sampling = inference_pb2.SamplingParams(
            temperature=self.temperature, max_tokens=max_tokens, stop_token_ids=stop
        )
        if self.seed is not None:  # reproducible per rollout and call, different across both
            sampling.seed = zlib.crc32(f"{self.seed}:{self.calls}".encode())
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=sampling,
            return_routed_experts=True,
            routed_experts_from=routes_from,
        )
        if cache_version is not None:
            request.prefix_cache_version = cache_version
        return await retrying(lambda: self._generate(request), self.retry, "inference Generate")

    async def _generate(self, request: inference_pb2.GenerateRequest) -> Generation:
        token_ids: list[int] = []
        logprobs: list[float] = []
        last = inference_pb2.GenerateResponse()
        async for chunk in self.stub.Generate(request, timeout=600):
            token_ids += chunk.token_ids
            logprobs += chunk.logprobs
            last = chunk
        routing = None
        if not routed_experts.is_empty(last.routed_experts):
            # Checked here, where a bad table can be blamed on the reply.
            start = request.routed_experts_from
            if last.routed_experts_start != start:
                raise routed_experts.RoutedExpertsError(
                    "routed_experts_shape",
                    "GenerateResponse.routed_experts_start",
                    f"{last.routed_experts_start}, asked for rows from {start}",
                )
            num_tokens = len(request.prompt_token_ids) + len(token_ids) - start
            routed_experts.check(last.routed_experts, num_tokens, "GenerateResponse.routed_experts")
            routing = last.routed_experts
        return Generation(
            token_ids=token_ids,
            logprobs=logprobs,
            version_spans=[(s.version, s.start, s.end) for s in last.version_spans],
            routing=routing,
            routing_start=request.routed_experts_from,
            num_cached_tokens=last.num_cached_tokens,
            finish_reason=inference_pb2.FinishReason.Name(last.finish_reason),
        )
