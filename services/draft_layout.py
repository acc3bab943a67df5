"""The trainer's first MTP head under the names of its vLLM speculative draft.

Shared by the trainer, which publishes the head with every policy version when its job
trains MTP heads, and inference, which loads it as an EAGLE draft
(``services.inference.mtp_draft``): one mapping, so the two cannot drift. A head's
tensors (``mtp.0.*`` in the trainer's state dict) map one by one, the fused
``gate_up`` split in two, so a rank that holds only some of them (a sharded job
publishes each dense tensor from one rank) maps its own.

Published versions carry the draft under ``DRAFT_PREFIX`` (``mtp_draft.model.proj.weight``
…): inference with a draft loads them into it, inference without one leaves them out.
"""

from __future__ import annotations

from typing import Any

import torch

ARCHITECTURE = "EagleEtudeMTP"
DRAFT_WEIGHTS = "model.safetensors"
DRAFT_PREFIX = "mtp_draft."
# The head the draft is: the first (vLLM reuses one draft module for every speculated
# token, so a draft of k tokens chains it on its own output).
DRAFT_HEAD = 0

_LAYER = "model.layers.0."
# The trainer's head names -> the draft's (vLLM's Qwen3 decoder-layer names).
_NAMES = {
    "hidden_norm.weight": "model.hidden_norm.weight",
    "embed_norm.weight": "model.embed_norm.weight",
    "proj.weight": "model.proj.weight",
    "attn_norm.weight": _LAYER + "input_layernorm.weight",
    "attn.q_proj.weight": _LAYER + "self_attn.q_proj.weight",
    "attn.k_proj.weight": _LAYER + "self_attn.k_proj.weight",
    "attn.v_proj.weight": _LAYER + "self_attn.v_proj.weight",
    "attn.o_proj.weight": _LAYER + "self_attn.o_proj.weight",
    "attn.q_norm.weight": _LAYER + "self_attn.q_norm.weight",
    "attn.k_norm.weight": _LAYER + "self_attn.k_norm.weight",
    "mlp_norm.weight": _LAYER + "post_attention_layernorm.weight",
    "down.weight": _LAYER + "mlp.down_proj.weight",
    "final_norm.weight": "model.final_norm.weight",
}
_GATE_UP = "gate_up.weight"
HEAD_TENSORS = frozenset({*_NAMES, _GATE_UP})
"""A head's tensor names (under ``mtp.<head>.``)."""


def draft_parts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor of a head (its name under ``mtp.<head>.``) as the draft's tensors."""
    if name == _GATE_UP:
        gate, up = tensor.chunk(2, dim=0)
        return {_LAYER + "mlp.gate_proj.weight": gate, _LAYER + "mlp.up_proj.weight": up}
    if name not in _NAMES:
        raise ValueError(
            f"the draft does not know the MTP tensor {name!r} (a head's: {sorted(HEAD_TENSORS)})"
        )
    return {_NAMES[name]: tensor}


def draft_tensors(mtp: dict[str, torch.Tensor], head: int = DRAFT_HEAD) -> dict[str, torch.Tensor]:
    """Head `head` (0-based) of an ``mtp.safetensors`` state dict under the draft's names
    (every tensor of the head, or ValueError)."""
    prefix = f"mtp.{head}."
    own = {name[len(prefix) :]: t for name, t in mtp.items() if name.startswith(prefix)}
    if not own:
        raise ValueError(f"no MTP head {head} (tensors {prefix}*) in the checkpoint")
    missing = HEAD_TENSORS - set(own)
    if missing:
        raise ValueError(f"MTP head {head} lacks {sorted(missing)}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in own.items():
        out |= draft_parts(name, tensor)
    return {name: t.contiguous() for name, t in out.items()}


def is_draft_head(name: str) -> bool:
    """Whether a trainer state-dict name is one of the draft head's tensors."""
    return name.startswith(f"mtp.{DRAFT_HEAD}.")


def published_draft(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A trainer state-dict tensor's part of a published version's draft: empty unless it
    is the draft head's, else its tensors under ``DRAFT_PREFIX``."""
    if not is_draft_head(name):
        return {}
    parts = draft_parts(name.removeprefix(f"mtp.{DRAFT_HEAD}."), tensor)
    return {DRAFT_PREFIX + part: t for part, t in parts.items()}


def split_draft(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A published version's tensors as (the served model's, the draft's under its own
    names)."""
    model = {n: t for n, t in tensors.items() if not n.startswith(DRAFT_PREFIX)}
    draft = {
        n.removeprefix(DRAFT_PREFIX): t for n, t in tensors.items() if n.startswith(DRAFT_PREFIX)
    }
    return model, draft


def draft_config(target: dict[str, Any]) -> dict[str, Any]:
    """The draft's config.json from the target's: a one-layer dense Qwen3 shape whose MLP
    is the head's (an expert's width)."""
    keys = (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "hidden_act",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
    )
    config = {key: target[key] for key in keys if key in target}
    config.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        num_hidden_layers=1,
        intermediate_size=target["moe_intermediate_size"],
        attention_bias=False,
    )
    return config
