"""The trainer's MTP head as a vLLM speculative-decoding draft (EAGLE's path).

vLLM 0.32 has no MTP draft for Qwen3-MoE, and none of its MTP classes is Etude's head
(docs/inference.md, Speculative decoding). Its EAGLE proposer, though, runs any draft
class whose name starts with ``Eagle`` and which takes the target's last hidden states
(after its final norm: what the trainer's heads are trained on) with the next token's
id. ``EagleEtudeMTP`` is head 1 of ``services.trainer.model.mtp`` in vLLM's layers:

    x = proj([hidden_norm(h), embed_norm(embed(t))])
    x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x));  out = final_norm(x)

with vLLM's Qwen3 attention (q/k RMSNorm, the target's rotary settings) and dense
SwiGLU, the target's embedding and LM head shared (the class has neither, so the
proposer hands it the target's). vLLM reuses one draft module for every speculated
token, so a draft of k tokens chains head 1 on its own output; the trainer's deeper
heads are not used.

``export_draft`` writes head 1 of a model directory's ``mtp.safetensors`` as a draft
directory; ``register`` (a ``vllm.general_plugins`` entry point, so it runs in every
vLLM process) makes the class known to vLLM.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from services.draft_layout import (
    ARCHITECTURE,
    DRAFT_WEIGHTS,
    draft_config,
    draft_tensors,
)

__all__ = [
    "ACCEPTED",
    "ARCHITECTURE",
    "DRAFTED",
    "DRAFTS",
    "DRAFT_WEIGHTS",
    "draft_config",
    "draft_tensors",
    "export_draft",
    "register",
    "speculation_counts",
]


def export_draft(
    model_dir: Path, out: Path, *, mtp_file: Path | None = None, head: int = 0
) -> Path:
    """Writes MTP head `head` as a vLLM draft directory at `out`: the heads of `mtp_file`
    (default: `model_dir`'s ``mtp.safetensors``, as the trainer saves them), the shape of
    `model_dir`'s config."""
    from safetensors.torch import load_file, save_file

    mtp_file = mtp_file or model_dir / "mtp.safetensors"
    if not mtp_file.is_file():
        raise FileNotFoundError(f"{mtp_file}: no MTP heads to draft with")
    tensors = draft_tensors(load_file(str(mtp_file)), head)
    target = json.loads((model_dir / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / DRAFT_WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(draft_config(target), indent=2) + "\n")
    return out


# vLLM's speculative-decoding counters (its Prometheus metrics, in the engine's process).
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


def speculation_counts() -> dict[str, float]:
    """Drafts, drafted and accepted tokens so far in this process (all engines)."""
    from prometheus_client import REGISTRY

    counts = dict.fromkeys((DRAFTS, DRAFTED, ACCEPTED), 0.0)
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name in counts:
                counts[sample.name] += sample.value
    return counts


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in each of its processes."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")


@functools.cache
def _draft_class() -> type:
    """``EagleEtudeMTP``, built on first use (vLLM is imported only where it runs)."""
    from torch import nn
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer

    class EtudeMTPModel(nn.Module):
        def __init__(self, vllm_config: VllmConfig, prefix: str, layer_index: int) -> None:
            super().__init__()
            speculative = vllm_config.speculative_config
            assert speculative is not None and speculative.draft_model_config is not None
            config = speculative.draft_model_config.hf_config
            width, eps = config.hidden_size, config.rms_norm_eps
            self.hidden_norm = RMSNorm(width, eps=eps)
            self.embed_norm = RMSNorm(width, eps=eps)
            self.proj = ReplicatedLinear(
                2 * width, width, bias=False, prefix=f"{prefix}.proj", return_bias=False
            )
            # The layer's prefix names its KV cache: after the target's layers.
            self.layers = nn.ModuleList(
                [
                    Qwen3DecoderLayer(
                        config,
                        cache_config=vllm_config.cache_config,
                        prefix=f"{prefix}.layers.{layer_index}",
                    )
                ]
            )
            self.final_norm = RMSNorm(width, eps=eps)
            self.embed_tokens: nn.Module  # the target's, set by the proposer

        def forward(
            self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            embeddings = self.embed_tokens(input_ids)
            joined = torch.cat(
                [self.hidden_norm(hidden_states), self.embed_norm(embeddings)], dim=-1
            )
            hidden, residual = self.layers[0](positions, self.proj(joined), None)
            hidden, _ = self.final_norm(hidden, residual)
            return hidden, hidden

    class EagleEtudeMTP(nn.Module):
        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__()
            speculative = vllm_config.speculative_config
            assert speculative is not None and speculative.draft_model_config is not None
            self.config = speculative.draft_model_config.hf_config
            target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
            self.model = EtudeMTPModel(vllm_config, f"{prefix}model", target_layers)
            self.logits_processor = LogitsProcessor(self.config.vocab_size)
            self.lm_head: nn.Module  # the target's, set by the proposer

        def forward(
            self,
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            hidden_states: torch.Tensor,
            inputs_embeds: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if inputs_embeds is not None:
                raise NotImplementedError("the Etude MTP draft takes token ids")
            outputs: tuple[torch.Tensor, torch.Tensor] = self.model(
                input_ids, positions, hidden_states
            )
            return outputs

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = self.logits_processor(self.lm_head, hidden_states)
            return logits

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            params = dict(self.named_parameters())
            # vLLM fuses q/k/v and gate/up: each loads into its shard of the fused weight.
            stacked: dict[str, tuple[str, str | int]] = {
                "q_proj": ("qkv_proj", "q"),
                "k_proj": ("qkv_proj", "k"),
                "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", 0),
                "up_proj": ("gate_up_proj", 1),
            }
            loaded: set[str] = set()
            # Parameter names follow the module tree (layers.0); only the attention's
            # prefix, which names its KV cache, counts after the target's layers.
            for name, tensor in weights:
                for short, (fused, shard) in stacked.items():
                    if f".{short}." in name:
                        target = name.replace(f".{short}.", f".{fused}.")
                        params[target].weight_loader(  # type: ignore[attr-defined]
                            params[target], tensor, shard
                        )
                        loaded.add(target)
                        break
                else:
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                    loaded.add(name)
            return loaded

    return EagleEtudeMTP


def __getattr__(name: str) -> Any:
    # vLLM imports the class by name (register's lazy "module:Class"): built on demand.
    if name == ARCHITECTURE:
        return _draft_class()
    raise AttributeError(name)
