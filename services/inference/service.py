"""The inference process: a vLLM engine behind the InferenceService contract.

Ready when the engine is loaded. Generate streams token ids, per-token logprobs
and weight-version spans. Routed-expert capture and in-flight weight updates are
not in this release yet: asking for them answers UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from services.api.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference import validation
from services.inference.engine import Engine
from services.run_config import EtudeConfig
from services.wire.client import Channels
from services.wire.errors import Unavailable, Unimplemented
from services.wire.server import run_service
from services.wire.service import Readiness, Service

_FINISH_REASONS = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "abort": inference_pb2.FINISH_REASON_ABORT,
}


def to_vllm_sampling(sampling: inference_pb2.SamplingParams) -> Any:
    """vLLM SamplingParams for a validated request: sampled-token logprobs, delta output."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        min_tokens=sampling.min_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        seed=sampling.seed if sampling.HasField("seed") else None,
        ignore_eos=sampling.ignore_eos,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """The InferenceService contract."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        engine = self._service.engine
        validation.validate_generate(
            request, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len
        )
        if request.return_routed_experts:
            raise Unimplemented("return_routed_experts: routed-expert capture is not built yet")
        if not engine.loaded:
            raise Unavailable("the engine is still loading")
        chunks = engine.generate(
            list(request.prompt_token_ids),
            to_vllm_sampling(request.sampling),
            request.request_id or None,
        )
        async for chunk in chunks:
            yield inference_pb2.GenerateResponse(
                token_ids=chunk.token_ids,
                logprobs=chunk.logprobs,
                version_spans=[
                    common_pb2.VersionSpan(version=v, start=s, end=e)
                    for v, s, e in chunk.version_spans
                ],
                finish_reason=_FINISH_REASONS.get(
                    chunk.finish_reason or "", inference_pb2.FINISH_REASON_UNSPECIFIED
                ),
                num_prompt_tokens=chunk.num_prompt_tokens,
                offset=chunk.offset,
            )

    async def NotifyVersion(
        self, request: common_pb2.PolicyVersionNotice, context: aio.ServicerContext
    ) -> inference_pb2.NotifyVersionResponse:
        raise Unimplemented("NotifyVersion: in-flight weight updates are not built yet")

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> inference_pb2.InferenceStatusResponse:
        engine = self._service.engine
        return inference_pb2.InferenceStatusResponse(
            info=await self._service.service_info(request.include_dependencies),
            serving_version=engine.serving_version,
            model=str(engine.config.model_dir),
            num_running=engine.num_in_flight,
            routed_experts_capture=False,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
        )


class InferenceService(Service):
    """Ready when the vLLM engine is loaded."""

    name = "inference"

    def __init__(self, config: EtudeConfig, channels: Channels) -> None:
        super().__init__(config, channels)
        self.engine = Engine(config.inference.engine)

    def register(self, server: aio.Server) -> list[str]:
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self), server)
        return [inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name]

    async def start(self) -> None:
        self.readiness = Readiness(False, "loading the vLLM engine")
        await self.engine.start()

    async def check_ready(self) -> Readiness:
        if not self.engine.loaded:
            return Readiness(False, "engine not loaded")
        return Readiness(True, f"serving policy version {self.engine.serving_version}")

    async def stop(self) -> None:
        await self.engine.stop()

    def status_fields(self) -> dict[str, str]:
        engine = self.engine
        return {
            "model": str(engine.config.model_dir),
            "serving version": str(engine.serving_version),
            "requests in flight": str(engine.num_in_flight),
            "max model len": str(engine.max_model_len),
        }


def run(config: EtudeConfig) -> None:
    """Runs one inference replica until SIGTERM."""
    run_service(InferenceService, config)
