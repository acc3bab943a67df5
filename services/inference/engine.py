"""The vLLM engine of one inference replica (AsyncLLM over a local model directory).

Token ids in, token ids out: the engine loads the tokenizer only for vLLM's own EOS
handling and never detokenizes. Weight versions: vLLM labels the spans of output
tokens with the label of the weights that sampled them; the initial weights carry
vLLM's label "default", reported as the model card's policy version, and every
in-flight update sets the label to the new version number.

Routed experts: on CUDA, vLLM's native capture (``enable_return_routed_experts``); on
CPU, the worker extension in ``services.inference.capture``. Both give, at the end of
a request, the expert ids of every position the engine ran or served from its prefix
cache, ``[tokens, layers, top_k]``, each row from the forward that computed that
position's KV; both keep routes with the cached KV blocks, so prefix caching stays on
with capture. A request returns the rows from ``routed_experts_from`` on: a multi-turn
caller holds its earlier turns' rows already, so the bytes of a rollout grow with its
tokens, not with turns x context.

The prefix cache is keyed by policy version (vLLM's ``cache_salt``): a request reuses
only KV blocks written under its cache version -- by default the version serving when it
is admitted, so a new rollout never attends to a prefix an older version encoded. A
rollout passes the version of its first call (``prefix_cache_version``), so its later
turns reuse its own KV across an update, as a request running across one keeps its KV
(vLLM's in-flight update): every position is encoded, and routed, once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.config.inference import EngineConfig
from services.draft_layout import split_draft
from services.dtypes import resolve_dtype

log = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_VERSION_LABEL = "default"
CAPTURE_EXTENSION = "services.inference.capture.RoutingCapture"


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
    # On the last chunk when asked for: [tokens run - routed_experts_start, layers, top_k].
    routed_experts: np.ndarray | None = None
    routed_experts_start: int = 0
    # Prompt tokens served from the prefix cache (known once the prompt is scheduled).
    num_cached_tokens: int = 0


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
        self._labels: dict[str, int] = {DEFAULT_VERSION_LABEL: self.serving_version}
        self._llm: Any = None
        self.on_cuda = torch.cuda.is_available()
        self.dtype = resolve_dtype(config.dtype, "cuda" if self.on_cuda else "cpu")
        self.capture_mode = "off"  # "native" | "worker" | "off"
        self.routing_shape: tuple[int, int] | None = None  # (moe layers, top_k)
        self.num_in_flight = 0
        self._forget: list[str] = []
        self._update_lock = asyncio.Lock()
        self._stale_draft_said = False

    @property
    def loaded(self) -> bool:
        """The engine is up and can generate."""
        return self._llm is not None

    def _engine_args(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        config = self.config
        capture = config.capture_routed_experts
        kwargs: dict[str, Any] = {}
        if capture and self.on_cuda:
            kwargs["enable_return_routed_experts"] = True
        if config.draft_dir is not None:
            # The MTP head as an EAGLE draft (services.inference.mtp_draft, registered in
            # every vLLM process by the package's vllm.general_plugins entry point).
            kwargs["speculative_config"] = {
                "method": "eagle",
                "model": str(config.draft_dir),
                "num_speculative_tokens": config.speculative_tokens,
            }
        return AsyncEngineArgs(
            model=str(config.model_dir),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size if self.on_cuda else 1,
            enable_expert_parallel=config.enable_expert_parallel and self.on_cuda,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=None if self.on_cuda else int(config.cpu_kv_cache_gib * GIB),
            # Both captures keep routes with the cached blocks (capture.py).
            enable_prefix_caching=config.enable_prefix_caching,
            block_size=config.block_size,
            worker_extension_cls=CAPTURE_EXTENSION,
            **kwargs,
        )

    async def start(self) -> None:
        """Builds the engine off the event loop so health checks keep answering."""
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.on_cuda and self.config.capture_routed_experts and self.config.draft_dir:
            # vLLM's native capture under speculation has not run yet (no GPU at hand);
            # the CPU capture keeps only the routes of tokens that stayed (tested).
            raise RuntimeError(
                "inference.engine: speculative decoding (draft_dir) with capture_routed_experts "
                "is not yet verified on CUDA: set capture_routed_experts = false to speculate"
            )
        args = self._engine_args()
        log.info(
            "starting vLLM on %s (%s, max_model_len %d)",
            self.config.model_dir,
            self.dtype,
            self.max_model_len,
        )
        self._llm = await asyncio.wait_for(
            asyncio.to_thread(AsyncLLM.from_engine_args, args), self.config.start_timeout_s
        )
        if self.config.capture_routed_experts:
            if self.on_cuda:
                self.capture_mode = "native"
            else:
                await self.set_capture(True)
        log.info(
            "vLLM engine ready, policy version %d, routed-expert capture %s",
            self.serving_version,
            self.capture_mode,
        )

    async def set_capture(self, enabled: bool) -> None:
        """Turns the CPU worker capture on or off (the benchmark measures both)."""
        if self.on_cuda:
            raise RuntimeError("on CUDA, capture is vLLM's native option, fixed at start-up")
        # Blocks cached while capture was off have no routes kept: forget them all.
        if self.config.enable_prefix_caching and not await self._llm.reset_prefix_cache():
            raise RuntimeError("could not reset the prefix cache (requests are running)")
        shapes = await self._llm.collective_rpc(
            "etude_capture_enable", args=(enabled, self.max_model_len)
        )
        self.routing_shape = tuple(shapes[0])
        self.capture_mode = "worker" if enabled else "off"

    async def stop(self) -> None:
        """Shuts the engine and its worker processes down."""
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)

    def _version(self, label: str) -> int:
        return self._labels.get(label, self.serving_version) if not label.isdigit() else int(label)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: Any,
        request_id: str | None = None,
        *,
        return_routed_experts: bool = False,
        routed_experts_from: int = 0,
        prefix_cache_version: int | None = None,
    ) -> AsyncIterator[Chunk]:
        """Streams the output of one request; aborts it in the engine if the caller goes away.

        With ``return_routed_experts`` the last chunk carries the routes of positions
        ``routed_experts_from`` (at most the prompt's length) and on. The request reuses
        prefix-cache blocks written under ``prefix_cache_version`` (default: the version
        serving now).
        """
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise RuntimeError("the engine is not started")
        if return_routed_experts and self.capture_mode == "off":
            raise RuntimeError("routed-expert capture is off on this replica")
        if sampling.output_kind != RequestOutputKind.DELTA:
            # Chunks are deltas (each at its offset); cumulative outputs would repeat
            # tokens, as many times as the stream happened to deliver them.
            raise ValueError("sampling.output_kind must be RequestOutputKind.DELTA")
        if not 0 <= routed_experts_from <= len(prompt_token_ids):
            raise ValueError(
                f"routed_experts_from {routed_experts_from} is outside the prompt "
                f"(0..{len(prompt_token_ids)})"
            )
        request_id = request_id or uuid.uuid4().hex
        offset = 0
        finished = False
        self.num_in_flight += 1
        try:
            cache_version = (
                self.serving_version if prefix_cache_version is None else prefix_cache_version
            )
            prompt = TokensPrompt(prompt_token_ids=prompt_token_ids, cache_salt=f"v{cache_version}")
            stream = self._llm.generate(prompt, sampling, request_id)
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
                chunk = Chunk(
                    offset=offset,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    version_spans=spans,
                    finish_reason=completion.finish_reason if finished else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=output.num_cached_tokens or 0,
                )
                if finished and return_routed_experts:
                    # Every position but the last sampled token's has run.
                    end = len(prompt_token_ids) + offset + len(token_ids) - 1
                    chunk.routed_experts = await self._routing(
                        request_id, completion, routed_experts_from, end
                    )
                    chunk.routed_experts_start = routed_experts_from
                yield chunk
                offset += len(token_ids)
        finally:
            self.num_in_flight -= 1
            if not finished and self._llm is not None:
                await self._llm.abort(request_id)
            if self.capture_mode == "worker" and not (finished and return_routed_experts):
                self._forget.append(request_id)

    async def _routing(self, request_id: str, completion: Any, start: int, end: int) -> np.ndarray:
        """The request's routes of positions ``start`` to ``end`` (exclusive)."""
        if self.capture_mode == "native":
            # vLLM's table covers the whole sequence, cached prefix blocks included (it
            # keeps routes per block hash); only the rows the caller lacks go out.
            routed: np.ndarray = np.asarray(completion.routed_experts)[start:end]
            return routed
        forget, self._forget = self._forget, []
        taken = await self._llm.collective_rpc(
            "etude_capture_take", args=({request_id: (start, end)}, forget)
        )
        if request_id not in taken[0]:
            raise RuntimeError(f"no routed experts were captured for request {request_id}")
        data, shape = taken[0][request_id]
        return np.frombuffer(data, dtype="<i2").reshape(tuple(shape))

    async def apply_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> float:
        """Loads new weights into the running engine; returns how long generation paused.

        Running requests keep their place and their KV cache: tokens after the switch
        come from the new weights, attending to context the old weights encoded. The
        version's MTP draft (``services.draft_layout``, published when its job trains MTP
        heads) goes into the engine's speculative draft in the same pause; an engine that
        does not speculate leaves it out.
        """
        model, draft = split_draft(dict(tensors))
        if draft and self.config.draft_dir is None:
            draft = {}  # this engine does not speculate: the version's draft is not for it
        elif self.config.draft_dir is not None and not draft and not self._stale_draft_said:
            self._stale_draft_said = True
            log.warning(
                "version %d carries no MTP draft (its job trains no MTP heads): the engine "
                "keeps speculating with the draft it has, which drifts from the policy",
                version,
            )
        async with self._update_lock:
            # Each part's loader in the engine's processes, and the file it reads.
            loads = {"etude_load_weights": (_weights_file(f"v{version}"), model)}
            if draft:
                loads["etude_load_draft_weights"] = (_weights_file(f"v{version}-draft"), draft)
            try:
                # Written while generation goes on; only the loads below pause it.
                for path, part in loads.values():
                    await asyncio.to_thread(_save, part, path)
                paused_at = time.perf_counter()
                await self._llm.pause_generation(mode="keep", clear_cache=False)
                try:
                    for method, (path, _) in loads.items():
                        await self._llm.collective_rpc(method, args=(path,))
                    await self._llm.update_weight_version(str(version))
                finally:
                    await self._llm.resume_generation()
                pause_s = time.perf_counter() - paused_at
            finally:
                for path, _ in loads.values():
                    os.unlink(path)
            self._labels[str(version)] = version
            self.serving_version = version
            return pause_s


def _weights_file(label: str) -> str:
    """A fresh file for weights handed to the engine's processes (in /dev/shm if it can)."""
    handle, path = tempfile.mkstemp(
        prefix=f"etude-weights-{label}-", suffix=".safetensors", dir=_shm_dir()
    )
    os.close(handle)
    return path


def _save(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors.items()}, path)


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
