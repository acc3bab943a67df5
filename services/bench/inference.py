"""`etude bench inference`: what routed-expert capture and in-flight updates cost.

One engine (the tiny model, or small unless --quick), the same concurrent prompts:

* ``capture_cost`` = tokens/s with capture off / tokens/s with capture on, measured
  in alternating rounds (best of each) in one run. The vLLM RFC reports 1.17x latency
  for its capture; target <= 1.05.
* ``update_pause_s``: how long generation stops for one in-flight weight update
  (median of several, taken while requests run), against ``step_time_s``, the decode
  step time while serving. ``pause_fraction_at_60s`` is the share of serving time lost
  when a version arrives every minute; target <= 1%.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from services.bench import BenchResult
from services.inference.config import EngineConfig
from services.inference.engine import Engine

TARGET_CAPTURE_COST = 1.05
TARGET_PAUSE_FRACTION = 0.01
CADENCE_S = 60.0


async def _throughput(
    engine: Engine, prompts: list[list[int]], max_tokens: int, routing: bool
) -> float:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = SamplingParams(
        temperature=1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        seed=0,
    )

    async def one(prompt: list[int]) -> int:
        count = 0
        async for chunk in engine.generate(prompt, sampling, return_routed_experts=routing):
            count += len(chunk.token_ids)
        return count

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens / (time.perf_counter() - started)


async def _measure(model_dir: Path, quick: bool) -> dict[str, Any]:
    engine = Engine(
        EngineConfig(model_dir=model_dir, max_model_len=1024, cpu_kv_cache_gib=0.5, max_num_seqs=32)
    )
    await engine.start()
    try:
        prompts = [[5 + i, 17, 42, 99, 7, 300, 11, 12] for i in range(16)]
        max_tokens = 128 if quick else 384
        await _throughput(engine, prompts[:2], 16, routing=False)  # warm-up
        on: list[float] = []
        off: list[float] = []
        for _ in range(2 if quick else 3):
            await engine.set_capture(False)
            off.append(await _throughput(engine, prompts, max_tokens, routing=False))
            await engine.set_capture(True)
            on.append(await _throughput(engine, prompts, max_tokens, routing=True))
        single = await _throughput(engine, prompts[:1], max_tokens, routing=True)

        from safetensors.torch import load_file

        weights = load_file(str(model_dir / "model.safetensors"))
        pauses = []
        load = asyncio.create_task(_throughput(engine, prompts, 4 * max_tokens, routing=True))
        for version in range(1, 4 if quick else 6):
            await asyncio.sleep(0.2)
            pauses.append(await engine.apply_weights(weights, version))
        await load
        return {"tps_on": max(on), "tps_off": max(off), "step_time_s": 1 / single, "pauses": pauses}
    finally:
        await engine.stop()


def run(quick: bool) -> BenchResult:
    """Capture on/off throughput and update pauses on a factory model."""
    from services.model_factory.build import init_model

    preset = "tiny" if quick else "small"
    with tempfile.TemporaryDirectory() as work:
        model_dir = Path(work) / preset
        init_model(preset, model_dir, seed=0)  # type: ignore[arg-type]
        measured = asyncio.run(_measure(model_dir, quick))
    pause = statistics.median(measured["pauses"])
    figures = {
        "tps_capture_on": measured["tps_on"],
        "capture_cost": measured["tps_off"] / measured["tps_on"],
        "update_pause_s": pause,
        "step_time_s": measured["step_time_s"],
        "pause_to_step_ratio": pause / measured["step_time_s"],
        "pause_fraction_at_60s": pause / CADENCE_S,
    }
    return BenchResult(
        figures=figures,
        baseline={"tps_capture_off": measured["tps_off"]},
        ok=figures["capture_cost"] <= TARGET_CAPTURE_COST
        and figures["pause_fraction_at_60s"] <= TARGET_PAUSE_FRACTION,
        target=(
            f"capture_cost <= {TARGET_CAPTURE_COST} and pause_fraction_at_60s <= "
            f"{TARGET_PAUSE_FRACTION} (one update a minute)"
        ),
        details={"model": preset, "pauses_s": measured["pauses"], "concurrent_requests": 16},
    )
