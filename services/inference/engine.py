"""The vLLM engine of one inference replica (AsyncLLM over a local model directory).

Token ids in, token ids out: the engine loads the tokenizer only for vLLM's own
EOS handling and never detokenizes. Weight versions: vLLM labels the spans of
output tokens with the label of the weights that sampled them; the initial
weights carry vLLM's label "default", which this module reports as the model
card's policy version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.inference.config import EngineConfig

log = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_VERSION_LABEL = "default"


@dataclass
class Chunk:
    """New output of one request since the previous chunk."""

    offset: int
    token_ids: list[int]
    logprobs: list[float]
    # (version, start, end) over the request's whole output, as known so far.
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0


def read_model_shape(model_dir: Path) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from an HF config.json."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"no model at {model_dir} (config.json missing); create one with `etude model init`"
        )
    config = json.loads(config_path.read_text())
    return int(config["vocab_size"]), int(config["max_position_embeddings"])


def initial_policy_version(model_dir: Path) -> int:
    """The policy version of the weights in `model_dir` (0 for a fresh factory model)."""
    card = model_dir / "etude_model.json"
    if not card.is_file():
        return 0
    return int(json.loads(card.read_text()).get("policy_version", 0))


class Engine:
    """One vLLM AsyncLLM; `start` loads it (tens of seconds on CPU), `generate` streams."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.vocab_size, model_positions = read_model_shape(config.model_dir)
        self.max_model_len = min(config.max_model_len, model_positions)
        self.serving_version = initial_policy_version(config.model_dir)
        self._initial_version = self.serving_version
        self._llm: Any = None
        self.num_in_flight = 0

    @property
    def loaded(self) -> bool:
        """The engine is up and can generate."""
        return self._llm is not None

    def _engine_args(self) -> Any:
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs

        config = self.config
        on_cuda = torch.cuda.is_available()
        return AsyncEngineArgs(
            model=str(config.model_dir),
            dtype=config.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size if on_cuda else 1,
            enable_expert_parallel=config.enable_expert_parallel and on_cuda,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=None if on_cuda else int(config.cpu_kv_cache_gib * GIB),
        )

    async def start(self) -> None:
        """Builds the engine off the event loop so health checks keep answering."""
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self._engine_args()
        log.info(
            "starting vLLM on %s (max_model_len %d)", self.config.model_dir, self.max_model_len
        )
        self._llm = await asyncio.wait_for(
            asyncio.to_thread(AsyncLLM.from_engine_args, args), self.config.start_timeout_s
        )
        log.info("vLLM engine ready, serving policy version %d", self.serving_version)

    async def stop(self) -> None:
        """Shuts the engine and its worker processes down."""
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)

    def _version(self, label: str) -> int:
        return self._initial_version if label == DEFAULT_VERSION_LABEL else int(label)

    async def generate(
        self, prompt_token_ids: list[int], sampling: Any, request_id: str | None = None
    ) -> AsyncIterator[Chunk]:
        """Streams the output of one request; aborts it in the engine if the caller goes away."""
        from vllm.inputs import TokensPrompt

        if self._llm is None:
            raise RuntimeError("the engine is not started")
        request_id = request_id or uuid.uuid4().hex
        offset = 0
        finished = False
        self.num_in_flight += 1
        try:
            stream = self._llm.generate(
                TokensPrompt(prompt_token_ids=prompt_token_ids), sampling, request_id
            )
            async for output in stream:
                completion = output.outputs[0]
                token_ids = list(completion.token_ids)
                logprobs = [
                    entry[token].logprob
                    for token, entry in zip(token_ids, completion.logprobs or [], strict=True)
                ]
                spans = [
                    (self._version(span.version), span.start, span.end)
                    for span in completion.weight_versions or []
                ]
                finished = output.finished
                yield Chunk(
                    offset=offset,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    version_spans=spans,
                    finish_reason=completion.finish_reason if finished else None,
                    num_prompt_tokens=len(prompt_token_ids),
                )
                offset += len(token_ids)
        finally:
            self.num_in_flight -= 1
            if not finished and self._llm is not None:
                await self._llm.abort(request_id)
