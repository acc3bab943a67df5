"""The inference process: a vLLM engine behind the InferenceService contract.

Generate streams token ids, per-token logprobs and weight-version spans, and on the
last chunk the routed experts when asked: from ``routed_experts_from`` on, the rows the
caller does not hold yet. With ``follow_weights`` the replica loads
every published version in flight (``services.inference.updates``) and turns ready
only once it serves the newest complete version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from services import routed_experts
from services.api.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.config.inference import InferenceProcessConfig
from services.inference import metrics, validation
from services.inference.engine import Engine
from services.inference.updates import WeightFollower
from services.messages import validate_version_notice
from services.model_source import fingerprint
from services.objectstore import open_store
from services.reconciler_client import ReconcilerClient
from services.weights.subscriber import WeightSubscriber
from services.wire.client import Channels
from services.wire.errors import FailedPrecondition, NotFound, Unavailable
from services.wire.server import run_service
from services.wire.service import Readiness, Service

log = logging.getLogger(__name__)

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
        if not engine.loaded:
            raise Unavailable("the engine is still loading")
        if request.return_routed_experts and engine.capture_mode == "off":
            raise FailedPrecondition(
                "return_routed_experts: capture is off on this replica "
                "(inference.engine.capture_routed_experts = false)"
            )
        chunks = engine.generate(
            list(request.prompt_token_ids),
            to_vllm_sampling(request.sampling),
            request.request_id or None,
            return_routed_experts=request.return_routed_experts,
            routed_experts_from=request.routed_experts_from,
            prefix_cache_version=(
                request.prefix_cache_version if request.HasField("prefix_cache_version") else None
            ),
        )
        async for chunk in chunks:
            metrics.GENERATED_TOKENS.inc(len(chunk.token_ids))
            response = inference_pb2.GenerateResponse(
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
            if chunk.finish_reason is not None:
                response.num_cached_tokens = chunk.num_cached_tokens
                metrics.PROMPT_TOKENS_CACHED.inc(chunk.num_cached_tokens)
            if chunk.routed_experts is not None:
                response.routed_experts.CopyFrom(routed_experts.encode(chunk.routed_experts))
                response.routed_experts_start = chunk.routed_experts_start
                metrics.ROUTED_EXPERTS_BYTES.inc(len(response.routed_experts.data))
            yield response

    async def NotifyVersion(
        self, request: common_pb2.PolicyVersionNotice, context: aio.ServicerContext
    ) -> inference_pb2.NotifyVersionResponse:
        validate_version_notice(request)
        follower = self._service.follower
        if follower is None:
            raise FailedPrecondition(
                "this replica does not follow published weights (inference.follow_weights)"
            )
        serving = self._service.engine.serving_version
        if request.version > serving:
            if not await asyncio.to_thread(follower.is_published, request.version):
                raise NotFound(
                    f"version {request.version} of run {self._service.config.run.name} is not "
                    "published (no manifest in the object store)"
                )
            follower.request(request.version)
        return inference_pb2.NotifyVersionResponse(accepted=True, serving_version=serving)

    async def GetStatus(
        self, request: common_pb2.StatusRequest, context: aio.ServicerContext
    ) -> inference_pb2.InferenceStatusResponse:
        engine = self._service.engine
        return inference_pb2.InferenceStatusResponse(
            info=await self._service.service_info(request.include_dependencies),
            serving_version=engine.serving_version,
            model=str(engine.config.model_dir),
            num_running=engine.num_in_flight,
            routed_experts_capture=engine.capture_mode != "off",
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
        )


class InferenceService(Service):
    """Ready when the vLLM engine is loaded."""

    name = "inference"
    config: InferenceProcessConfig

    def __init__(
        self, config: InferenceProcessConfig, channels: Channels, engine: Engine | None = None
    ) -> None:
        super().__init__(config, channels)
        # The vLLM engine of ``inference.engine`` unless one is given (tests).
        self.engine = engine if engine is not None else Engine(config.inference.engine)
        self.follower: WeightFollower | None = None
        if config.inference.follow_weights:
            # Versions trained from another model (architecture, tokenizer) are refused,
            # naming both. (An engine a test hands in serves no model directory.)
            model = fingerprint(config.inference.engine.model_dir) if engine is None else None
            subscriber = WeightSubscriber(
                open_store(config.object_store), config.run.name, config.weights, model
            )
            self.follower = WeightFollower(self.engine, subscriber)

    def register(self, server: aio.Server) -> list[str]:
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self), server)
        return [inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name]

    async def start(self) -> None:
        self.readiness = Readiness(False, "loading the vLLM engine")
        await self.engine.start()
        metrics.SERVING_VERSION.set(self.engine.serving_version)
        metrics.CAPTURE_ON.set(float(self.engine.capture_mode != "off"))
        if self.follower is not None:
            self.readiness = Readiness(False, "loading the newest published version")
            await self.follower.catch_up()  # a cold replica serves the newest version first
            self.background.start("weight-follower", self._follow_weights)

    async def _follow_weights(self) -> None:
        """The follower, on notices from the version served now: run again after a
        crash, it resubscribes from where the replica is, so no notice is lost."""
        assert self.follower is not None, "started only when following weights"
        client = ReconcilerClient(self.channels.get("reconciler"))
        await self.follower.run(client.policy_versions(after_version=self.engine.serving_version))

    async def check_ready(self) -> Readiness:
        if not self.engine.loaded:
            return Readiness(False, "engine not loaded")
        return Readiness(True, f"serving policy version {self.engine.serving_version}")

    async def stop(self) -> None:
        if self.follower is not None:  # stopped with the background tasks; a load ends
            await self.follower.wait_idle()
        await self.engine.stop()

    def status_fields(self) -> dict[str, str]:
        engine = self.engine
        return {
            "model": str(engine.config.model_dir),
            "serving version": str(engine.serving_version),
            "requests in flight": str(engine.num_in_flight),
            "max model len": str(engine.max_model_len),
            "routed-expert capture": engine.capture_mode,
            "last update pause": f"{self.follower.last_pause_s:.3f} s" if self.follower else "-",
            "last update error": (self.follower.last_error or "none") if self.follower else "-",
        }


def run(config: InferenceProcessConfig) -> None:
    """Runs one inference replica until SIGTERM."""
    run_service(InferenceService, config)
