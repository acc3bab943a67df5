"""The trainer's Qwen3-MoE: packed-sequence model, router replay, HF checkpoint I/O.

* ``architecture`` — the model's shape, read from an HF ``config.json``.
* ``layers``       — RMSNorm, RoPE and causal GQA attention over packed sequences.
* ``routing``      — the softmax top-k router with router replay and its plausibility filter.
* ``transformer``  — the decoder and causal LM (``Qwen3MoE``), ``PackedInputs``.
* ``prefix_tree``  — packing sequences that begin alike as a tree, shared tokens once.
* ``mtp``          — optional multi-token-prediction heads, trained by self-distillation.
* ``hf_io``        — loading and saving the HF safetensors layout vLLM serves.
"""

from services.trainer.model.architecture import Architecture
from services.trainer.model.hf_io import from_hf, load_pretrained, save_pretrained, to_hf
from services.trainer.model.routing import Router, RoutingDecision, filter_replay
from services.trainer.model.transformer import (
    DTYPES,
    ForwardOutput,
    PackedInputs,
    Qwen3MoE,
    resolve_compute_dtype,
    resolve_experts_precision,
    token_logprobs,
)

__all__ = [
    "DTYPES",
    "Architecture",
    "ForwardOutput",
    "PackedInputs",
    "Qwen3MoE",
    "Router",
    "RoutingDecision",
    "filter_replay",
    "from_hf",
    "load_pretrained",
    "resolve_compute_dtype",
    "resolve_experts_precision",
    "save_pretrained",
    "to_hf",
    "token_logprobs",
]
