"""The harness's view of inference: one Generate call, token ids in and out."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib

import grpc
import numpy as np
from grpc import aio

from services.api.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.envs.harness import Generation

log = logging.getLogger(__name__)

_INDEX_DTYPES = {common_pb2.INDEX_DTYPE_UINT8: "<u1", common_pb2.INDEX_DTYPE_INT16: "<i2"}


def unpack_routing(routed: common_pb2.RoutedExperts) -> np.ndarray | None:
    """The packed [tokens, layers, top_k] array, or None when there is none."""
    if not routed.shape:
        return None
    dtype = _INDEX_DTYPES.get(routed.dtype, "<i4")
    return np.frombuffer(routed.data, dtype=dtype).reshape(tuple(routed.shape)).astype(np.int16)


class InferenceGenerator:
    """Calls InferenceService.Generate with the rollout's sampling settings.

    A replica that is UNAVAILABLE (restarting, still loading, gone mid-stream) is waited
    for, with backoff, up to ``unavailable_wait_s``; the call then starts over (tokens of a
    broken stream are dropped). Counting such a fault as a failed rollout attempt would
    burn the slot's attempts in a second while a replica restarts.
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
        self.unavailable_wait_s = unavailable_wait_s
        self.calls = 0

    async def __call__(self, prompt: list[int], max_tokens: int, stop: list[int]) -> Generation:
        self.calls += 1
        sampling = inference_pb2.SamplingParams(
            temperature=self.temperature, max_tokens=max_tokens, stop_token_ids=stop
        )
        if self.seed is not None:  # reproducible per rollout and call, different across both
            sampling.seed = zlib.crc32(f"{self.seed}:{self.calls}".encode())
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling=sampling, return_routed_experts=True
        )
        deadline = time.monotonic() + self.unavailable_wait_s
        delay = 0.25
        while True:
            try:
                return await self._generate(request)
            except aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                log.info("inference unavailable (%s); retrying in %.1f s", error.details(), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _generate(self, request: inference_pb2.GenerateRequest) -> Generation:
        token_ids: list[int] = []
        logprobs: list[float] = []
        last = inference_pb2.GenerateResponse()
        async for chunk in self.stub.Generate(request, timeout=600):
            token_ids += chunk.token_ids
            logprobs += chunk.logprobs
            last = chunk
        return Generation(
            token_ids=token_ids,
            logprobs=logprobs,
            version_spans=[(s.version, s.start, s.end) for s in last.version_spans],
            routing=unpack_routing(last.routed_experts),
            finish_reason=inference_pb2.FinishReason.Name(last.finish_reason),
        )
