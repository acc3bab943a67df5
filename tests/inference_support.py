"""Reference computations for the inference tests (transformers on the same checkpoint)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from services import routed_experts
from services.api.v1 import common_pb2


def unpack_routing(routed: common_pb2.RoutedExperts) -> np.ndarray:
    """The wire's packed array as [tokens, layers, top_k] integers (any row count)."""
    table = routed_experts.decode(routed, num_tokens=routed.shape[0])
    assert table is not None, "no routed experts"
    return table


def load_hf(model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """transformers' Qwen3-MoE in bf16, optionally with other weights (checkpoint names:
    transformers fuses the experts when it loads a checkpoint, so the weights go through
    a checkpoint directory, as vLLM's do)."""
    import shutil
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if state is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as directory:
        shutil.copy(model_dir / "config.json", directory)
        save_file(
            {n: t.contiguous() for n, t in state.items()},
            f"{directory}/model.safetensors",
            metadata={"format": "pt"},
        )
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()


def router_probabilities(model: torch.nn.Module, tokens: list[int]) -> list[torch.Tensor]:
    """Per MoE layer, the router's softmax over experts for every token: [tokens, experts]."""
    with torch.no_grad():
        output = model(torch.tensor([tokens]), output_router_logits=True)
    return [
        torch.softmax(logits.float(), dim=-1).reshape(len(tokens), -1)
        for logits in output.router_logits
    ]


def perturbed_state(model_dir: Path, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with noise added: a 'newer policy' that is clearly different."""
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(model_dir / "model.safetensors"))
    out = {}
    for name, tensor in state.items():
        noise = (
            torch.randn(tensor.shape, generator=generator)
            * scale
            * tensor.float().std().clamp(min=1e-3)
        )
        out[name] = (tensor.float() + noise).to(torch.bfloat16)
    out["lm_head.weight"] = (out["lm_head.weight"].float() * 2).to(
        torch.bfloat16
    )  # peakier outputs
    return out


def continuation_logprobs(
    old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], generated: list[int], switch: int
) -> torch.Tensor:
    """Logprobs of generated[switch:] as an engine that switched weights at `switch` computes
    them: the old weights encoded the context up to generated[switch - 2], the new weights
    ran every later input token (attending to that old context)."""
    with torch.no_grad():
        prefix = prompt + generated[: switch - 1]
        cache = old(torch.tensor([prefix]), use_cache=True).past_key_values
        inputs = generated[switch - 1 : -1]
        logits = new(torch.tensor([inputs]), past_key_values=cache, use_cache=True).logits.float()
    logprobs = torch.log_softmax(logits[0], dim=-1)
    return logprobs.gather(1, torch.tensor(generated[switch:])[:, None])[:, 0]


def sequence_logprobs(
    model: torch.nn.Module, prompt: list[int], generated: list[int]
) -> torch.Tensor:
    """Logprobs of `generated` after `prompt` under one set of weights."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits.float()
    logprobs = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0]
