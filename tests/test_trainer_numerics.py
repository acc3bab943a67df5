"""``numerics = "fused"``: the trainer rounds where vLLM's CPU kernels do, checked op by op.

Each check runs vLLM's own CPU kernel (the ones its Qwen3-MoE forward calls with
``enforce_eager``) and the trainer's fused counterpart on the same bf16 inputs, and
also the trainer's eager (transformers-order) path, which must disagree far more:
otherwise the check would pass whatever the fused path did.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from services.config.trainer import ModelSettings
from services.trainer.model import PackedInputs, load_pretrained, token_logprobs
from services.trainer.model.architecture import Architecture
from services.trainer.model.layers import RMSNorm, apply_rope, rope_tables
from services.trainer.model.transformer import MoEBlock
from services.trainer.precision import PrecisionConfig, rounding
from tests.trainer_support import sharpen_model

ARCH = Architecture(
    vocab_size=512,
    hidden_size=256,
    num_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    top_k=4,
    moe_intermediate_size=128,
    max_position_embeddings=4096,
)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).float().mean())


def _moe_block(numerics: str) -> MoEBlock:
    generator = torch.Generator().manual_seed(0)
    block = MoEBlock(ARCH, PrecisionConfig(precision="bf16"), numerics)  # type: ignore[arg-type]
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=generator) / 4)
        # bf16-representable master weights: both sides then use the same experts.
        for weight in (block.experts.gate_up, block.experts.down):
            weight.copy_(weight.bfloat16().float())
    return block


def test_fused_moe_routes_and_combines_like_vllms_cpu_router_and_fused_moe() -> None:
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    x = torch.randn(96, ARCH.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    fused, eager = _moe_block("fused"), _moe_block("eager")
    eager.load_state_dict(fused.state_dict())
    with torch.no_grad():
        ours, decision = fused(x, None, None, 0.0)
        theirs_eager, _ = eager(x, None, None, 0.0)
        # vLLM's CPU router: top-k of the bf16 logits, softmax over them in bf16.
        weights, experts = _softmax_topk(x @ fused.gate.weight.bfloat16().T, ARCH.top_k, True)
        vllm_out = torch.empty_like(x)
        cpu_fused_moe(
            vllm_out,
            x,
            cpu_prepack_moe_weight(fused.experts.gate_up.bfloat16(), "vec"),
            cpu_prepack_moe_weight(fused.experts.down.bfloat16(), "vec"),
            None,
            None,
            weights.contiguous(),
            experts.contiguous(),
            "silu",
            "vec",
        )
    assert torch.equal(decision.experts.sort(-1).values, experts.long().sort(-1).values)
    # The same bits but where float32 sums in another order land on a rounding boundary.
    assert _bits_equal(ours, vllm_out) > 0.99
    assert _bits_equal(theirs_eager, vllm_out) < 0.7


def test_fused_rope_is_vllms_cpu_rotary_kernel_bit_for_bit() -> None:
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(2)
    tokens, heads, head_dim = 80, 4, ARCH.head_dim
    query = torch.randn(tokens, heads * head_dim, generator=generator).bfloat16()
    positions = torch.arange(tokens)
    cos, sin = rope_tables(positions, head_dim, ARCH.rope_theta, torch.bfloat16)
    half = head_dim // 2
    cache = torch.cat((cos[:, :half], sin[:, :half]), dim=-1)  # vLLM's [pos, cos | sin]
    rotated = query.clone()
    ops.rotary_embedding(positions, rotated, None, head_dim, cache, True)
    by_head = query.view(tokens, heads, head_dim)
    fused = apply_rope(by_head, cos, sin, "fused").reshape(tokens, -1)
    eager = apply_rope(by_head, cos, sin, "eager").reshape(tokens, -1)
    assert torch.equal(fused, rotated)
    assert _bits_equal(eager, rotated) < 0.95


def test_fused_add_norm_is_vllms_fused_add_rms_norm() -> None:
    from vllm.ir.ops import fused_add_rms_norm

    generator = torch.Generator().manual_seed(3)
    branch, residual = (
        torch.randn(64, ARCH.hidden_size, generator=generator).bfloat16() for _ in range(2)
    )
    norm = RMSNorm(ARCH.hidden_size, ARCH.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(ARCH.hidden_size, generator=generator).bfloat16() + 0.5)
        normed, new_residual = fused_add_rms_norm.impls["native"].impl_fn(
            branch.clone(), residual.clone(), norm.weight.bfloat16(), ARCH.rms_norm_eps
        )
        stream = residual.float() + branch.float()
        ours = norm(stream, torch.bfloat16)
        eager = norm(residual + branch)
    assert torch.equal(stream.bfloat16(), new_residual)
    assert torch.equal(ours, normed)
    assert not torch.equal(eager, normed)


def test_fused_numerics_changes_rounding_only(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stored to nearest even, as a CPU with AVX-512 and CUDA do (truncation, on AVX2, is
    # biased, and lands farther away: the gap claim below is about rounding to nearest).
    monkeypatch.setattr(rounding, "CPU_TRUNCATES_BF16", False)
    model_dir = sharpen_model(tiny_model, tmp_path / "sharp")
    sequences = [list(range(20, 61)), list(range(100, 120))]
    inputs = PackedInputs.pack([s[:-1] for s in sequences])
    targets = torch.tensor([t for s in sequences for t in s[1:]])
    results = {}
    for numerics in ("eager", "fused"):
        for dtype in (torch.float32, torch.bfloat16):
            model = load_pretrained(model_dir, dtype=dtype, numerics=numerics)
            with torch.no_grad():
                results[numerics, dtype], _ = token_logprobs(model, model(inputs).hidden, targets)
    exact = results["eager", torch.float32]
    # In float32 there is nothing to round: the two orders are the same function.
    assert (results["fused", torch.float32] - exact).abs().max() < 1e-5
    # In bf16 they differ by rounding, and rounding less often lands no farther away.
    eager_gap = (results["eager", torch.bfloat16] - exact).abs().mean()
    fused_gap = (results["fused", torch.bfloat16] - exact).abs().mean()
    assert not torch.equal(results["fused", torch.bfloat16], results["eager", torch.bfloat16])
    assert fused_gap < eager_gap


def test_kernel_round_truncates_where_vllms_cpu_kernels_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 1 + 2^-8 + 2^-9 lies between two bf16 values: nearest even goes up, truncation down.
    x = torch.tensor([1 + 2**-8 + 2**-9, -(1 + 2**-8 + 2**-9), 3.0], requires_grad=True)
    truncated = rounding.truncate_to_bfloat16(x)
    assert truncated.tolist() == [1.0, -1.0, 3.0]
    assert x.to(torch.bfloat16).tolist() == [1 + 2**-7, -(1 + 2**-7), 3.0]
    truncated.float().sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 1.0, 1.0]  # as a cast passes it
    with pytest.raises(ValueError, match="float32"):
        rounding.truncate_to_bfloat16(x.detach().bfloat16())
    for truncates, expected in ((True, -1.0), (False, -(1 + 2**-7))):
        monkeypatch.setattr(rounding, "CPU_TRUNCATES_BF16", truncates)
        assert rounding.kernel_round(x.detach(), torch.bfloat16)[1].item() == expected
        assert rounding.kernel_round(x.detach(), torch.float32).dtype == torch.float32


def test_fused_numerics_keeps_router_gradients_under_replay(tiny_model: Path) -> None:
    model = load_pretrained(tiny_model, dtype=torch.bfloat16, numerics="fused")
    arch = model.arch
    sequence = list(range(30, 60))
    generator = torch.Generator().manual_seed(4)
    rows = len(sequence) * arch.num_layers
    routes = torch.stack(
        [torch.randperm(arch.num_experts, generator=generator)[: arch.top_k] for _ in range(rows)]
    ).view(len(sequence), arch.num_layers, arch.top_k)
    inputs = PackedInputs.pack([sequence], [routes], num_layers=arch.num_layers, top_k=arch.top_k)
    output = model(inputs)
    logprobs, _ = token_logprobs(model, output.hidden[:-1], torch.tensor(sequence[1:]))
    logprobs.sum().backward()
    assert torch.equal(output.experts.sort(-1).values, routes.sort(-1).values)
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad is not None
        assert layer.mlp.gate.weight.grad.abs().sum() > 0


def test_fused_numerics_refuses_the_quantized_recipe_by_name() -> None:
    with pytest.raises(ValidationError, match="numerics"):
        ModelSettings(numerics="fused", experts_precision="nvfp4_fwd_mxfp8_bwd")
    assert ModelSettings(numerics="fused").numerics == "fused"
