"""The shape of a Qwen3-MoE model, read from an HF ``config.json``.

The trainer supports the architecture the model factory writes and Qwen's own
Qwen3-MoE checkpoints use: every layer MoE, GQA attention with per-head q/k RMSNorm,
default RoPE, no attention bias, no sliding window. Anything else is refused with a
message naming the field, rather than trained subtly wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """Sizes and constants of one Qwen3-MoE model."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, num_experts "
                f"({self.num_experts})]"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Architecture:
        """From the dict of an HF Qwen3-MoE ``config.json``."""
        model_type = config.get("model_type")
        if model_type != "qwen3_moe":
            raise ValueError(f"config.json model_type must be 'qwen3_moe', got {model_type!r}")
        unsupported = {
            "attention_bias": config.get("attention_bias", False),
            "tie_word_embeddings": config.get("tie_word_embeddings", False),
            "use_sliding_window": config.get("use_sliding_window", False),
            "mlp_only_layers": bool(config.get("mlp_only_layers") or []),
            "decoder_sparse_step != 1": config.get("decoder_sparse_step", 1) != 1,
        }
        for name, value in unsupported.items():
            if value:
                raise ValueError(
                    f"config.json {name} = {value!r} is not supported (the trainer implements "
                    "all-MoE layers, untied embeddings, no attention bias, full attention)"
                )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json rope_type {rope.get('rope_type')!r} is not supported")
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        if num_experts is None:
            raise ValueError("config.json has neither num_experts nor num_local_experts")
        hidden_size = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden_size // heads),
            num_experts=int(num_experts),
            top_k=int(config["num_experts_per_tok"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            max_position_embeddings=int(config["max_position_embeddings"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Architecture:
        """From ``model_dir/config.json``."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no model at {model_dir} (config.json missing); make one with `etude model init`"
            )
        return cls.from_hf_config(json.loads(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (for logs and checkpoints)."""
        return asdict(self)
