"""Settings of the inference service (vLLM engine and its listeners)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from services.config import (
    DEFAULT_MODEL_DIR,
    GrpcServerConfig,
    HttpServerConfig,
    ServiceConfig,
    SharedConfig,
    StrictModel,
)


class EngineConfig(StrictModel):
    """The vLLM engine of one replica."""

    model_dir: Path = Field(
        DEFAULT_MODEL_DIR,
        description="HF-layout model directory: model.dir, which names the model for every "
        "service; set this only to repeat it.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weights and activations dtype. 'auto': bfloat16 on a GPU and on a CPU "
        "with native bf16 GEMMs (AVX-512/AMX), float32 on other CPUs (vLLM generated 1.75x "
        "faster in float32 than in bfloat16 on a 2-core AVX2 EPYC).",
    )
    max_model_len: int = Field(2048, ge=16, le=1 << 20, description="Context length in tokens.")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Sequences scheduled at once.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per replica (CUDA only).")
    enable_expert_parallel: bool = Field(False, description="Expert parallelism (CUDA only).")
    enforce_eager: bool = Field(True, description="No graph capture/compilation (fast start).")
    cpu_kv_cache_gib: float = Field(
        1.0, gt=0, le=1024, description="KV cache size on the CPU backend, in GiB."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may use (CUDA only)."
    )
    seed: int = Field(0, ge=0, description="Engine seed (per-request seeds override it).")
    capture_routed_experts: bool = Field(
        True,
        description=(
            "Record the experts every token was routed to (for router replay). Routes are "
            "kept with the prefix cache's blocks, so caching stays on with capture."
        ),
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV cache of shared prefixes (a multi-turn rollout's earlier "
        "turns, a group's task prompt); keyed by policy version.",
    )
    block_size: int | None = Field(
        None,
        ge=16,
        le=1024,
        multiple_of=16,
        description="Tokens per KV cache block, the prefix cache's unit; unset: vLLM's "
        "default (128 on CPU, 16 on CUDA). vLLM's CPU attention needs a multiple of 32.",
    )
    start_timeout_s: float = Field(600.0, gt=0, description="Give up starting the engine after.")
    draft_dir: Path | None = Field(
        None,
        description="A draft exported from the policy's MTP head (etude model draft; "
        "services/inference/mtp_draft.py): vLLM drafts speculative_tokens tokens a step with "
        "it and the policy verifies them, so what is sampled does not change. A version that "
        "carries a draft (its job trains MTP heads) replaces it in flight. With "
        "capture_routed_experts on CPU only (CUDA's native capture under speculation is not "
        "yet verified).",
    )
    speculative_tokens: int = Field(
        0, ge=0, le=16, description="Tokens the draft proposes a step (with draft_dir)."
    )

    @model_validator(mode="after")
    def _speculation(self) -> EngineConfig:
        if (self.draft_dir is None) != (self.speculative_tokens == 0):
            raise ValueError(
                "speculative decoding needs both draft_dir and speculative_tokens >= 1; got "
                f"draft_dir = {self.draft_dir}, speculative_tokens = {self.speculative_tokens}"
            )
        return self


class InferenceConfig(ServiceConfig):
    """One inference replica: a vLLM engine behind the Generate API."""

    grpc: GrpcServerConfig = Field(
        default_factory=lambda: GrpcServerConfig(port=50053), description="gRPC listener."
    )
    http: HttpServerConfig = Field(
        default_factory=lambda: HttpServerConfig(port=9103), description="HTTP listener."
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine.")
    follow_weights: bool = Field(
        False,
        description=(
            "Load every version the trainer publishes ([weights], [object_store]); the "
            "replica turns ready only once it serves the newest complete version."
        ),
    )


class InferenceProcessConfig(SharedConfig):
    """What an inference process reads: the shared sections and ``[inference]``."""

    inference: InferenceConfig = Field(
        default_factory=InferenceConfig, description="Inference service."
    )

    @model_validator(mode="after")
    def _one_model(self) -> InferenceProcessConfig:
        """``model.dir`` is the one model of the run: the engine serves it, and the trainer
        and envs, which read only ``model.dir``, start from it and tokenize with it. Naming
        another model at ``inference.engine.model_dir`` is an error, not a choice."""
        engine = self.inference.engine
        model_dir = self.model.directory
        if "model_dir" in engine.model_fields_set and engine.model_dir != model_dir:
            named = "" if self.model.dir is not None else ", its default"
            raise ValueError(
                f"model.dir ({model_dir}{named}) and inference.engine.model_dir "
                f"({engine.model_dir}) name two models; set model.dir only"
            )
        if engine.model_dir != model_dir:
            engine.model_dir = model_dir
        return self
