"""Times the trainer's CUDA paths against the per-expert / per-sequence loops they
replace and prints one JSON line (tools/gpu_check.sh)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from services.trainer.model.layers import causal_attention
from services.trainer.precision import PrecisionConfig, grouped_gemm
from services.trainer.precision.backends import select_backend


def _ms(step: Callable[[], object], repeats: int = 20) -> float:
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def figures() -> dict[str, object]:
    """Forward+backward times of the experts and the attention of one packed microbatch."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    num_experts, tokens_per_expert, d_model, d_ff = 64, 256, 2048, 768
    x = torch.randn(num_experts * tokens_per_expert, d_model, device=device, generator=generator)
    x = x.bfloat16().requires_grad_()
    weight = torch.randn(num_experts, d_ff, d_model, device=device, generator=generator) / 45
    weight.requires_grad_()
    sizes = [tokens_per_expert] * num_experts
    bf16 = PrecisionConfig(precision="bf16")

    def experts_grouped() -> None:
        grouped_gemm(x, weight, sizes, bf16).sum().backward()

    def experts_loop() -> None:
        rows = x.split(sizes)
        out = torch.cat([r @ w.bfloat16().T for r, w in zip(rows, weight.unbind(0), strict=True)])
        out.sum().backward()

    lengths = [512, 1024, 2048, 256, 4096]
    cu_seqlens = [0]
    for length in lengths:
        cu_seqlens.append(cu_seqlens[-1] + length)
    q, k, v = (
        torch.randn(cu_seqlens[-1], heads, 128, device=device, generator=generator)
        .bfloat16()
        .requires_grad_()
        for heads in (32, 4, 4)
    )

    def attention_varlen() -> None:
        causal_attention(q, k, v, cu_seqlens).sum().backward()

    def attention_loop() -> None:
        causal_attention(q.float(), k.float(), v.float(), cu_seqlens).sum().backward()

    grouped_ms, loop_ms = _ms(experts_grouped), _ms(experts_loop)
    varlen_ms, sdpa_ms = _ms(attention_varlen), _ms(attention_loop)
    return {
        "device": torch.cuda.get_device_name(device),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "torch": torch.__version__,
        "recipe_backend": select_backend(device).name,
        "experts_grouped_ms": round(grouped_ms, 3),
        "experts_loop_ms": round(loop_ms, 3),
        "experts_speedup": round(loop_ms / grouped_ms, 2),
        "attention_varlen_bf16_ms": round(varlen_ms, 3),
        "attention_sdpa_per_sequence_fp32_ms": round(sdpa_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tests-rc", type=int, required=True)
    parser.add_argument("--tests-s", type=int, required=True)
    parser.add_argument("--tests-summary", default="")
    args = parser.parse_args()
    result: dict[str, object] = {
        "gpu_tests_ok": args.tests_rc == 0,
        "gpu_tests": args.tests_summary,
        "gpu_tests_s": args.tests_s,
    }
    result.update(figures())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
