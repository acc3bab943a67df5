"""`etude bench inference`: what routed-expert capture and in-flight updates cost.

One engine (the tiny model, or small unless --quick), the same concurrent prompts:

* ``capture_cost`` = tokens/s with capture off / tokens/s with capture on, measured
  in alternating rounds (best of each) in one run. The vLLM RFC reports 1.17x latency
  for its capture; target <= 1.05.
* ``update_pause_s``: how long generation stops for one in-flight weight update
  (median of several, taken while requests run), against ``step_time_s``, the decode
  step time while serving. ``pause_fraction_at_60s`` is the share of serving time lost
  when a version arrives every minute; target <= 1%.
* ``prefill_ratio`` = prompt tokens the engine computed (not served from its prefix
  cache) over concurrent 4-turn rollouts with capture on / with capture off, the cache
  on in both (target <= 1.10: capture no longer turns the cache off). Each turn's prompt
  is the previous context plus a tool output, as the harness builds it.
  ``prefill_ratio_without_cache`` is what capture cost before, when it turned the cache
  off (every prompt computed whole).
* ``routing_bytes_per_rollout`` (mean, capture on, each call asking only for the rows
  the rollout lacks) and ``routing_bytes_per_token``; ``routing_bytes_whole_context_ratio``
  = the bytes had every call returned its whole context's table / the bytes sent.
* ``spec_speedup`` = greedy tokens/s of one request with speculative decoding / without
  (an MTP head fitted to the frozen model by self-distillation, ``SPEC_TOKENS`` drafted
  a step; two engines, capture off in both), ``spec_speedup_batch`` the same for the 16
  concurrent requests, ``spec_acceptance`` = draft tokens the model accepted / drafted,
  ``spec_outputs_equal`` 1 when every greedy output is the same with and without. On the
  factory model the prompts are token ids (its text is noise, so a draft is rarely
  right); ``ETUDE_BENCH_SPEC_MODEL_DIR`` names a trained model (a ``make run``'s base
  model or an exported version, with its tokenizer) to measure on instead, prompted with
  16 held-out synthetic tasks as the harness opens a rollout.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from services.bench import BenchResult, BenchSettingError
from services.config.inference import EngineConfig
from services.inference.engine import Engine
from services.inference.mtp_draft import ACCEPTED, DRAFTED, speculation_counts

TARGET_CAPTURE_COST = 1.05
SPEC_TOKENS = 2
SPEC_PROMPTS = 16
SPEC_MODEL_VARIABLE = "ETUDE_BENCH_SPEC_MODEL_DIR"
TARGET_PAUSE_FRACTION = 0.01
TARGET_PREFILL_RATIO = 1.10
CADENCE_S = 60.0
NUM_TURNS = 4


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


def _sampling(max_tokens: int, seed: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        seed=seed,
    )


async def _multi_turn(
    engine: Engine, num_rollouts: int, prompt_tokens: int, turn_tokens: int, routing: bool
) -> dict[str, float]:
    """Concurrent ``NUM_TURNS``-turn rollouts (each turn's prompt: the context so far and
    a tool output); the prompt tokens computed and served from the cache, and the routing
    bytes sent (rows from what each rollout already holds) against a whole-context table
    per call."""
    from services import routed_experts

    totals = {"computed": 0.0, "prompt": 0.0, "bytes": 0.0, "whole_bytes": 0.0, "tokens": 0.0}

    async def rollout(index: int) -> None:
        context = [(7 * index + t) % 500 + 20 for t in range(prompt_tokens)]
        held = 0
        for turn in range(NUM_TURNS):
            if turn:
                context += [(31 * turn + 3 * t + index) % 500 + 20 for t in range(turn_tokens)]
            generated: list[int] = []
            last = None
            stream = engine.generate(
                context,
                _sampling(turn_tokens, seed=index * NUM_TURNS + turn),
                return_routed_experts=routing,
                routed_experts_from=held,
            )
            async for chunk in stream:
                generated += chunk.token_ids
                last = chunk
            assert last is not None
            totals["prompt"] += len(context)
            totals["computed"] += len(context) - last.num_cached_tokens
            if routing:
                assert last.routed_experts is not None
                sent = len(routed_experts.encode(last.routed_experts).data)
                row_bytes = sent / max(len(last.routed_experts), 1)
                totals["bytes"] += sent
                totals["whole_bytes"] += (len(context) + len(generated) - 1) * row_bytes
            context += generated
            held = len(context) - 1
        totals["tokens"] += len(context)

    await asyncio.gather(*(rollout(i) for i in range(num_rollouts)))
    return totals


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

        # Versions were applied above: rollouts from here run under the last one.
        num_rollouts, prompt_tokens, turn_tokens = (4, 96, 24) if quick else (8, 256, 48)
        await engine.set_capture(False)
        off_turns = await _multi_turn(engine, num_rollouts, prompt_tokens, turn_tokens, False)
        await engine.set_capture(True)
        on_turns = await _multi_turn(engine, num_rollouts, prompt_tokens, turn_tokens, True)
        return {
            "tps_on": max(on),
            "tps_off": max(off),
            "step_time_s": 1 / single,
            "pauses": pauses,
            "turns_on": on_turns,
            "turns_off": off_turns,
            "num_rollouts": num_rollouts,
        }
    finally:
        await engine.stop()


async def _greedy(
    engine: Engine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    """Tokens/s of greedy generation for `prompts` at once, and what each generated."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=0,
        output_kind=RequestOutputKind.DELTA,
    )

    async def one(prompt: list[int]) -> list[int]:
        return [t async for chunk in engine.generate(prompt, sampling) for t in chunk.token_ids]

    started = time.perf_counter()
    outputs = await asyncio.gather(*(one(p) for p in prompts))
    return sum(map(len, outputs)) / (time.perf_counter() - started), list(outputs)


async def _speculation(
    model_dir: Path, draft_dir: Path, quick: bool, prompts: list[list[int]] | None = None
) -> dict[str, Any]:
    """Greedy tokens/s of one and of 16 requests without, then with, the draft."""
    prompts = prompts or [[5 + i, 17, 42, 99, 7, 300, 11, 12] for i in range(16)]
    max_tokens = 64 if quick else 192
    measured: dict[str, Any] = {}
    for label, draft in (("plain", None), ("spec", draft_dir)):
        engine = Engine(
            EngineConfig(
                model_dir=model_dir,
                max_model_len=1024,
                cpu_kv_cache_gib=0.5,
                max_num_seqs=32,
                capture_routed_experts=False,
                draft_dir=draft,
                speculative_tokens=SPEC_TOKENS if draft else 0,
            )
        )
        await engine.start()
        try:
            await _greedy(engine, prompts[:2], 16)  # warm-up
            before = speculation_counts()
            single, _ = await _greedy(engine, prompts[:1], max_tokens)
            batch, outputs = await _greedy(engine, prompts, max_tokens)
            after = speculation_counts()
        finally:
            await engine.stop()
        measured[label] = {
            "single": single,
            "batch": batch,
            "outputs": outputs,
            "counts": {name: after[name] - before[name] for name in after},
        }
    return measured


def spec_model(factory_dir: Path) -> tuple[Path, list[list[int]] | None]:
    """The model the speculation figures are measured on, and its prompts (None: the
    default token-id prompts): ``ETUDE_BENCH_SPEC_MODEL_DIR``'s, or the factory model."""
    chosen = os.environ.get(SPEC_MODEL_VARIABLE)
    if not chosen:
        return factory_dir, None
    from transformers import AutoTokenizer

    from services.config.envs import HarnessConfig
    from services.envs.harness import Generation, Harness
    from services.families import load_family
    from services.trainer.model import Architecture

    try:  # a model the trainer can load (to fit its head), with the tokenizer it speaks
        Architecture.from_model_dir(Path(chosen))
        tokenizer = AutoTokenizer.from_pretrained(chosen)
    except (OSError, ValueError, KeyError) as error:
        raise BenchSettingError(f"{SPEC_MODEL_VARIABLE}={chosen!r}: {error}") from error

    async def prompts_only(*_: Any, **__: Any) -> Generation:
        raise RuntimeError("the benchmark only builds prompts")

    harness = Harness(prompts_only, tokenizer, HarnessConfig())
    tasks = load_family("synthetic").tasks("heldout")[:SPEC_PROMPTS]
    return Path(chosen), [harness.prompt(task.instruction, []) for task in tasks]


def _spec_figures(factory_dir: Path, work: Path, quick: bool) -> tuple[dict[str, float], Any]:
    """The speculative-decoding figures (and details) with a freshly fitted MTP head."""
    from services.inference.mtp_draft import export_draft
    from services.trainer.mtp_distill import distill_heads

    model_dir, prompts = spec_model(factory_dir)
    steps = 30 if quick else 100
    heads = work / "mtp.safetensors"
    losses = distill_heads(model_dir, heads, steps=steps)
    draft = export_draft(model_dir, work / "draft", mtp_file=heads)
    measured = asyncio.run(_speculation(model_dir, draft, quick, prompts))
    plain, spec = measured["plain"], measured["spec"]
    counts = spec["counts"]
    drafted = counts[DRAFTED]
    figures = {
        "spec_speedup": spec["single"] / plain["single"],
        "spec_speedup_batch": spec["batch"] / plain["batch"],
        "spec_acceptance": counts[ACCEPTED] / max(drafted, 1),
        "spec_outputs_equal": float(spec["outputs"] == plain["outputs"]),
    }
    baseline = {"tps_greedy_single": plain["single"], "tps_greedy_batch": plain["batch"]}
    details = {
        "spec_model": str(model_dir) if prompts else "factory",
        "spec_prompts": "harness (synthetic held-out)" if prompts else "token ids",
        "spec_tokens": SPEC_TOKENS,
        "mtp_fit_steps": steps,
        "mtp_fit_loss": losses[-1],
    }
    return figures | {"tps_spec_single": spec["single"]}, (baseline, details)


def run(quick: bool) -> BenchResult:
    """Capture on/off throughput and update pauses on a factory model."""
    from services.model_factory.build import init_model

    preset = "tiny" if quick else "small"
    with tempfile.TemporaryDirectory() as work:
        model_dir = Path(work) / preset
        init_model(preset, model_dir, seed=0)  # type: ignore[arg-type]
        measured = asyncio.run(_measure(model_dir, quick))
        spec, (spec_baseline, spec_details) = _spec_figures(model_dir, Path(work), quick)
    pause = statistics.median(measured["pauses"])
    on_turns, off_turns = measured["turns_on"], measured["turns_off"]
    rollouts = measured["num_rollouts"]
    figures = {
        "tps_capture_on": measured["tps_on"],
        "capture_cost": measured["tps_off"] / measured["tps_on"],
        "update_pause_s": pause,
        "step_time_s": measured["step_time_s"],
        "pause_to_step_ratio": pause / measured["step_time_s"],
        "pause_fraction_at_60s": pause / CADENCE_S,
        "prefill_ratio": on_turns["computed"] / off_turns["computed"],
        "prefill_ratio_without_cache": on_turns["prompt"] / off_turns["computed"],
        "prefill_tokens_per_rollout": on_turns["computed"] / rollouts,
        "routing_bytes_per_rollout": on_turns["bytes"] / rollouts,
        "routing_bytes_per_token": on_turns["bytes"] / on_turns["tokens"],
        "routing_bytes_whole_context_ratio": on_turns["whole_bytes"] / on_turns["bytes"],
        **spec,
    }
    return BenchResult(
        figures=figures,
        baseline={
            "tps_capture_off": measured["tps_off"],
            "prefill_tokens_per_rollout_capture_off": off_turns["computed"] / rollouts,
            **spec_baseline,
        },
        ok=figures["capture_cost"] <= TARGET_CAPTURE_COST
        and figures["pause_fraction_at_60s"] <= TARGET_PAUSE_FRACTION
        and figures["prefill_ratio"] <= TARGET_PREFILL_RATIO
        and figures["spec_outputs_equal"] == 1.0,
        target=(
            f"capture_cost <= {TARGET_CAPTURE_COST}, pause_fraction_at_60s <= "
            f"{TARGET_PAUSE_FRACTION} (one update a minute) and prefill_ratio <= "
            f"{TARGET_PREFILL_RATIO} ({NUM_TURNS}-turn rollouts); speculation changes no "
            "greedy output (spec_speedup is reported, no target yet)"
        ),
        details={
            "model": preset,
            "pauses_s": measured["pauses"],
            "concurrent_requests": 16,
            "multi_turn_rollouts": rollouts,
            "turns": NUM_TURNS,
            **spec_details,
        },
    )
