"""Model presets: sizes of the Qwen3-MoE models the factory makes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PresetName = Literal["tiny", "small"]


class ModelPreset(BaseModel):
    """Shape of a Qwen3-MoE model and its tokenizer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(
        ge=512,
        le=262_144,
        description=(
            "Embedding rows. The tokenizer gets at most this many tokens (fewer when the corpus "
            "runs out of merges); the rest are padding rows, as in Qwen's checkpoints."
        ),
    )
    hidden_size: int = Field(ge=16, description="Residual stream width.")
    num_layers: int = Field(ge=1, description="Decoder layers (all MoE).")
    num_attention_heads: int = Field(ge=1, description="Query heads.")
    num_key_value_heads: int = Field(ge=1, description="Key/value heads (GQA).")
    head_dim: int = Field(ge=16, description="Per-head width; vLLM's CPU attention needs >= 32.")
    num_experts: int = Field(ge=2, description="Routed experts per MoE layer.")
    num_experts_per_token: int = Field(ge=1, description="Top-k of the router.")
    moe_intermediate_size: int = Field(ge=8, description="Hidden width of each expert's SwiGLU.")
    max_position_embeddings: int = Field(ge=128, description="Context length.")
    rope_theta: float = Field(10_000.0, gt=0, description="RoPE base.")
    corpus_bytes: int = Field(ge=10_000, description="Size of the tokenizer training corpus.")

    @model_validator(mode="after")
    def _consistent(self) -> ModelPreset:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"num_experts_per_token ({self.num_experts_per_token}) exceeds "
                f"num_experts ({self.num_experts})"
            )
        return self

    def hf_config(self, special_ids: dict[str, int]) -> dict[str, Any]:
        """Keyword arguments of transformers' Qwen3MoeConfig."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            # Dense MLP width; unused because every layer is MoE (mlp_only_layers = []).
            "intermediate_size": 4 * self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_token,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": False,
            "bos_token_id": special_ids["<|endoftext|>"],
            "eos_token_id": special_ids["<|endoftext|>"],
            "pad_token_id": special_ids["<|pad|>"],
        }


PRESETS: dict[PresetName, ModelPreset] = {
    # For tests: loads in seconds everywhere (< 2M parameters).
    "tiny": ModelPreset(
        vocab_size=1024,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        max_position_embeddings=2048,
        corpus_bytes=400_000,
    ),
    # For the CPU demo (10-30M parameters).
    "small": ModelPreset(
        vocab_size=4096,
        hidden_size=256,
        num_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=16,
        num_experts_per_token=4,
        moe_intermediate_size=128,
        max_position_embeddings=4096,
        corpus_bytes=2_000_000,
    ),
}
