"""The MTP head as a vLLM speculative-decoding draft (services/inference/mtp_draft.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.config.inference import EngineConfig
from services.inference.mtp_draft import (
    ARCHITECTURE,
    DRAFTED,
    DRAFTS,
    draft_tensors,
    export_draft,
    speculation_counts,
)
from services.trainer.model.architecture import Architecture
from services.trainer.model.mtp import MTPHead


def head_file(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """One fresh MTP head for `model_dir`'s shape, saved as the trainer names it."""
    head = MTPHead(Architecture.from_model_dir(model_dir))
    head.reset_parameters(torch.Generator().manual_seed(seed))
    tensors = {f"mtp.0.{n}": p.detach().contiguous() for n, p in head.named_parameters()}
    save_file(tensors, str(out))
    return out


def test_a_head_exports_as_a_one_layer_draft(tiny_model: Path, tmp_path: Path) -> None:
    heads = head_file(tiny_model, tmp_path / "mtp.safetensors")
    draft = export_draft(tiny_model, tmp_path / "draft", mtp_file=heads)
    config = json.loads((draft / "config.json").read_text())
    target = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["num_hidden_layers"] == 1
    assert config["intermediate_size"] == target["moe_intermediate_size"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == target[key]
    source, written = load_file(str(heads)), load_file(str(draft / "model.safetensors"))
    gate, up = source["mtp.0.gate_up.weight"].chunk(2, dim=0)
    layer = "model.layers.0."
    assert torch.equal(written[layer + "mlp.gate_proj.weight"], gate)
    assert torch.equal(written[layer + "mlp.up_proj.weight"], up)
    assert torch.equal(written["model.proj.weight"], source["mtp.0.proj.weight"])
    assert torch.equal(
        written[layer + "self_attn.q_norm.weight"], source["mtp.0.attn.q_norm.weight"]
    )
    # Every tensor of the head is in the draft, once (gate_up as two).
    assert len(written) == len(source) + 1


def test_a_draft_is_refused_when_it_cannot_be_made(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no MTP heads"):
        export_draft(tiny_model, tmp_path / "draft")
    heads = load_file(str(head_file(tiny_model, tmp_path / "mtp.safetensors")))
    with pytest.raises(ValueError, match="no MTP head 1"):
        draft_tensors(heads, head=1)
    with pytest.raises(ValueError, match="does not know"):
        draft_tensors({**heads, "mtp.0.extra.weight": torch.zeros(1)})


def test_speculation_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both draft_dir and speculative_tokens"):
        EngineConfig(draft_dir=tmp_path, capture_routed_experts=False)
    with pytest.raises(ValueError, match="both draft_dir and speculative_tokens"):
        EngineConfig(speculative_tokens=2, capture_routed_experts=False)
    with pytest.raises(ValueError, match="capture_routed_experts cannot be on"):
        EngineConfig(draft_dir=tmp_path, speculative_tokens=2)
    EngineConfig(draft_dir=tmp_path, speculative_tokens=2, capture_routed_experts=False)


@pytest.mark.slow
def test_the_draft_speculates_and_changes_nothing_sampled(tiny_model: Path, tmp_path: Path) -> None:
    """vLLM loads the draft through the package's plugin, drafts with it, and greedy
    outputs equal the engine's without a draft (the policy verifies every token)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from services.inference.engine import Engine

    draft = export_draft(
        tiny_model, tmp_path / "draft", mtp_file=head_file(tiny_model, tmp_path / "mtp.safetensors")
    )
    prompts = [list(range(40 + i, 72 + i)) for i in range(3)]
    greedy = SamplingParams(
        temperature=0.0, max_tokens=24, logprobs=0, output_kind=RequestOutputKind.DELTA
    )

    async def serve(draft_dir: Path | None) -> tuple[list[list[int]], dict[str, float]]:
        engine = Engine(
            EngineConfig(
                model_dir=tiny_model,
                max_num_seqs=4,
                max_model_len=256,
                cpu_kv_cache_gib=0.25,
                capture_routed_experts=False,
                draft_dir=draft_dir,
                speculative_tokens=2 if draft_dir else 0,
            )
        )
        await engine.start()
        try:
            before = speculation_counts()
            outputs = []
            for prompt in prompts:
                chunks = [chunk async for chunk in engine.generate(prompt, greedy)]
                outputs.append([t for c in chunks for t in c.token_ids])
            after = speculation_counts()
            return outputs, {k: after[k] - before.get(k, 0.0) for k in after}
        finally:
            await engine.stop()

    plain, _ = asyncio.run(serve(None))
    speculated, counts = asyncio.run(serve(draft))
    assert speculated == plain
    assert counts[DRAFTS] > 0 and counts[DRAFTED] == 2 * counts[DRAFTS]


def test_heads_fit_to_a_frozen_model(tiny_model: Path, tmp_path: Path) -> None:
    from services.trainer.mtp_distill import distill_heads

    out = tmp_path / "mtp.safetensors"
    losses = distill_heads(tiny_model, out, steps=6, tokens_per_step=512, max_seq_len=128, lr=1e-2)
    assert len(losses) == 6 and losses[-1] < losses[0]
    fitted = load_file(str(out))
    fresh = load_file(str(head_file(tiny_model, tmp_path / "fresh.safetensors")))
    assert {n: t.shape for n, t in fitted.items()} == {n: t.shape for n, t in fresh.items()}
    assert not torch.equal(fitted["mtp.0.proj.weight"], fresh["mtp.0.proj.weight"])
    # The export takes what the fit wrote.
    export_draft(tiny_model, tmp_path / "draft", mtp_file=out)
    with pytest.raises(ValueError, match="steps must be"):
        distill_heads(tiny_model, out, steps=0)
