"""Measures the packing cost model ``a * L + b * L**2`` on the model that will train.

One decoder layer of the model's architecture (attention and MoE, the precision
recipe, the compute dtype) runs forward and backward on sequences of several lengths;
the best time of each length is fitted by least squares to ``c + a * L + b * L**2``
(``c``, a fixed cost per call, is dropped). The result is normalized to ``a = 1``: only
the ratio matters to the partitioner. Used by
``[trainer.job.dist.packing] calibrate = true`` at start-up and by
``etude bench packing``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from services.trainer.distributed.packing import CostModel
from services.trainer.model.architecture import Architecture
from services.trainer.model.layers import rope_tables
from services.trainer.model.transformer import DecoderLayer
from services.trainer.precision import PrecisionConfig

DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048)


def _seconds(
    layer: DecoderLayer, arch: Architecture, length: int, dtype: torch.dtype, device: torch.device
) -> float:
    generator = torch.Generator().manual_seed(length)
    hidden = torch.randn(length, arch.hidden_size, generator=generator).to(device, dtype)
    hidden.requires_grad_(True)
    rope = rope_tables(torch.arange(length, device=device), arch.head_dim, arch.rope_theta, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    out, _ = layer(hidden, rope, [0, length], None, None, 0.0)
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(
    arch: Architecture,
    *,
    dtype: torch.dtype = torch.bfloat16,
    precision: PrecisionConfig | None = None,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    repeats: int = 3,
    device: torch.device | None = None,
) -> dict[int, float]:
    """Best forward + backward seconds of one decoder layer at each length."""
    device = device or torch.device("cpu")
    precision = precision or PrecisionConfig(precision="bf16")
    generator = torch.Generator().manual_seed(0)
    layer = DecoderLayer(arch, precision)
    with torch.no_grad():
        for param in layer.parameters():  # unit fan-in scale: routes spread over experts
            if param.dim() >= 2:
                scale = param.shape[-1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    layer.to(device)
    usable = [n for n in lengths if n <= arch.max_position_embeddings]
    if len(usable) < 3:
        raise ValueError(
            f"calibration needs three lengths within max_position_embeddings "
            f"({arch.max_position_embeddings}), got {list(lengths)}"
        )
    for length in usable:  # warm-up: the first call at a shape picks (and caches) kernels
        _seconds(layer, arch, length, dtype, device)
    best = dict.fromkeys(usable, float("inf"))
    # Rounds over every length, so that a burst of load elsewhere spoils one round, not
    # every repeat of one length.
    for _ in range(repeats):
        for length in usable:
            best[length] = min(best[length], _seconds(layer, arch, length, dtype, device))
    return best


def fit(seconds: dict[int, float]) -> CostModel:
    """Least-squares ``c + a * L + b * L**2`` through the measurements; ``a = 1, b / a``.

    ``c`` is what a call costs whatever its length (kernel launches, the router's and
    the layer's fixed work): it is paid once per microbatch, not per sequence, so it is
    fitted and left out. Each point is weighted by ``1 / t`` so that short lengths count
    as much as long ones (relative error). A negative fitted ``b`` (noise, or attention
    too cheap to see) is taken as 0; a non-positive ``a`` falls back to the longest
    length's time per token.
    """
    lengths = np.array(sorted(seconds), dtype=np.float64)
    times = np.array([seconds[int(n)] for n in lengths])
    design = np.stack([np.ones_like(lengths), lengths, lengths**2], axis=1) / times[:, None]
    (_, a, b), *_ = np.linalg.lstsq(design, np.ones_like(times), rcond=None)
    if a <= 0:
        a = float(times[-1] / lengths[-1])
    return CostModel(per_token=1.0, per_token_pair=max(float(b), 0.0) / float(a))


def calibrate(
    arch: Architecture,
    *,
    dtype: torch.dtype = torch.bfloat16,
    precision: PrecisionConfig | None = None,
    device: torch.device | None = None,
) -> CostModel:
    """``fit(measure(...))``."""
    return fit(measure(arch, dtype=dtype, precision=precision, device=device))
