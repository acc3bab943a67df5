"""`etude bench replay`: how far router replay closes the train/inference logprob gap.

A tiny model that routes as Composer 2's does is served by a real inference service
process (vLLM, bf16) with routed-expert capture on; it samples completions of code
prompts and returns, per generated token, its logprob and, per input token and MoE
layer, the experts it was routed to. The trainer's model (bf16, the same checkpoint)
then recomputes the logprobs of the generated tokens twice, in the same run: routing
with its own router (the baseline) and replaying inference's routes; and that in both of
the trainer's rounding orders (``model.numerics``): the default ``"eager"``
(transformers' order) gives the headline figures; ``"fused"``, which rounds where vLLM's
CPU kernels do, the same figures with the suffix ``_fused``. Figures:

* ``mismatch_without_replay``, ``mismatch_with_replay``: mean |trainer logp - vLLM logp|
  over generated tokens;
* ``mismatch_ratio`` = without / with (target >= 5: replay removes most of the gap);
* the same gap's 99th percentile and maximum, with and without replay: a flipped route
  shows in the tail long before it moves the mean;
* ``extreme_fraction_without_replay``, ``extreme_fraction_with_replay``: the fraction of
  generated tokens whose probability the trainer and vLLM put more than a factor
  ``EXTREME_TAU`` (2) apart, |Δlogp| > ln 2 -- the "extreme tokens" of the R3 paper (Ma et
  al., arXiv 2510.11370), which wreck importance ratios and which replay is for;
* ``replacement_rate``: the plausibility filter's replaced fraction of replayed choices;
* ``route_agreement_without_replay``: fraction of (token, layer) where the trainer's own
  router picked the experts inference used;
* ``bf16_noise_floor``: mean |trainer bf16 - trainer fp32| on the same tokens, both
  replaying inference's routes: the part of the gap that is bf16 rounding, which no
  routing can remove. The ratio can only be large where routing flips dominate it.
* ``mismatch_fp32_with_replay``: mean |trainer fp32 logp - vLLM logp|, replaying: how
  far inference's bf16 forward is from the exact one. Well below ``mismatch_with_replay``,
  vLLM is nearer the exact forward and the trainer's bf16 rounds more; about equal, both
  sides round as much, differently.

The model: ``tiny``'s width (64) and 8 layers, each routing a token to 8 of 384 experts
as Kimi K2.5 does, the open checkpoint Composer 2 is trained from (``DEFAULT_SHAPE``),
trained first as the base model is (continued pretraining, then SFT; 150 steps each, 30
with ``--quick``). Replay repairs routes that flip, so the benchmark needs a router
with many near-equal choices and experts that training has made different: the
untrained ``tiny`` preset (2 of 8) flips 1% of its routes, between experts that are
still alike, and measures rounding instead (docs/trainer.md has the sweep).

``ETUDE_BENCH_REPLAY_SHAPE=layers:experts:top_k`` (e.g. ``16:64:8``) serves a model of
that shape instead, ``ETUDE_BENCH_REPLAY_STEPS=cpt:sft`` (e.g. ``150:600``, or ``0:0``
for the factory's untrained weights) trains it that many steps, and
``ETUDE_BENCH_REPLAY_MODEL_DIR`` serves a model directory as it is.

The same run also measures a multi-turn workload (``services.bench.replay_turns``):
rollouts of 3 turns with tool output between them and a weight update after the first,
their routes stitched from each call's new rows as the harness does. Its figures are
prefixed ``multiturn_``; ``multiturn_ratio`` (without / with replay) is meant to be at
least the single-turn ``mismatch_ratio``: routes from sampling time replay as well over
turns and versions as over one generation.

Nothing here is made up by the trainer: without capture on the replica, the benchmark
fails and says so.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from services import routed_experts
from services.api.v1 import inference_pb2, inference_pb2_grpc
from services.bench import BenchResult, BenchSettingError, replay_turns
from services.config.launcher import BaseModelConfig
from services.launcher.processes import ManagedProcess
from services.model_factory.presets import PRESETS, ModelPreset
from services.trainer.model.layers import Numerics
from services.wire.client import make_channel
from services.wire.ports import free_ports

TARGET_RATIO = 5.0
EXTREME_TAU = 2.0  # extreme: the two engines' probabilities differ by more than this factor
MODEL_DIR_VARIABLE = "ETUDE_BENCH_REPLAY_MODEL_DIR"
SHAPE_VARIABLE = "ETUDE_BENCH_REPLAY_SHAPE"
STEPS_VARIABLE = "ETUDE_BENCH_REPLAY_STEPS"
FACTORY_TINY = "factory tiny (seed 0)"
# Composer 2 trains Kimi K2.5, which routes each token to 8 of its 384 experts (61 layers
# and a shared expert too, which Qwen3-MoE has no counterpart for).
DEFAULT_SHAPE = "8:384:8"


def _colon_ints(variable: str, text: str, form: str, example: str) -> list[int]:
    """``text`` (``variable``'s value) as the integers of ``form``, e.g. ``a:b``."""
    parts = text.split(":")
    try:
        if len(parts) != form.count(":") + 1:
            raise ValueError
        return [int(part) for part in parts]
    except ValueError:
        raise BenchSettingError(f"{variable}={text!r}: expected {form}, e.g. {example}") from None


def _reasons(error: ValidationError) -> str:
    return "; ".join(problem["msg"] for problem in error.errors())


def shape_preset(text: str) -> ModelPreset:
    """``layers:experts:top_k`` -> ``tiny``'s shape with that many layers and that routing."""
    layers, experts, top_k = _colon_ints(SHAPE_VARIABLE, text, "layers:experts:top_k", "16:64:8")
    fields = {"num_layers": layers, "num_experts": experts, "num_experts_per_token": top_k}
    try:
        return ModelPreset.model_validate(PRESETS["tiny"].model_dump() | fields)
    except ValidationError as error:
        raise BenchSettingError(f"{SHAPE_VARIABLE}={text!r}: {_reasons(error)}") from None


def training_settings(text: str | None, quick: bool) -> BaseModelConfig:
    """``cpt:sft`` -> how the shaped model is built: that many CPT and SFT steps (unset: 150
    each, 30 with ``quick``), the rest as `etude run` builds its base model."""
    if text is None:
        cpt = sft = 30 if quick else 150
    else:
        cpt, sft = _colon_ints(STEPS_VARIABLE, text, "cpt_steps:sft_steps", "150:600")
    try:
        return BaseModelConfig(cpt_steps=cpt, sft_steps=sft)
    except ValidationError as error:
        raise BenchSettingError(f"{STEPS_VARIABLE}={text!r}: {_reasons(error)}") from None


def served_model(quick: bool, workdir: Path) -> tuple[Path, str]:
    """The model to serve and how the report names it."""
    chosen, shape = os.environ.get(MODEL_DIR_VARIABLE), os.environ.get(SHAPE_VARIABLE)
    if chosen and shape:
        raise BenchSettingError(f"set {MODEL_DIR_VARIABLE} or {SHAPE_VARIABLE}, not both")
    steps_text = os.environ.get(STEPS_VARIABLE)
    if steps_text is not None and chosen:
        raise BenchSettingError(
            f"{STEPS_VARIABLE} sets how the benchmark trains its model; "
            f"{MODEL_DIR_VARIABLE} serves one as it is: set one of them"
        )
    if chosen:
        from services.trainer.model import Architecture

        try:  # the trainer's own check: a model is there, and one it can replay
            Architecture.from_model_dir(Path(chosen))
        except (FileNotFoundError, ValueError, KeyError) as error:
            raise BenchSettingError(f"{MODEL_DIR_VARIABLE}={chosen!r}: {error}") from error
        return Path(chosen), chosen
    from rich.console import Console

    from services.launcher.base_model import build_base_model

    preset = shape_preset(shape or DEFAULT_SHAPE)
    settings = training_settings(steps_text, quick)
    model_dir = workdir / "shaped"
    build_base_model(preset, model_dir, settings, Console(stderr=True))
    routing = "" if shape else " (Kimi K2.5 routing, as Composer 2)"
    return model_dir, (
        f"tiny width, {preset.num_layers} layers, top-{preset.num_experts_per_token} of "
        f"{preset.num_experts} experts{routing}, "
        f"after {settings.cpt_steps} CPT + {settings.sft_steps} SFT steps"
    )


def _config(path: Path, model_dir: Path, grpc_port: int, http_port: int, max_len: int) -> None:
    path.write_text(
        '[run]\nname = "bench-replay"\n'
        f'[object_store]\nurl = "file://{path.parent / "store"}"\n'
        f'[endpoints]\ninference = "127.0.0.1:{grpc_port}"\n'
        f'[inference]\ngrpc = {{ host = "127.0.0.1", port = {grpc_port} }}\n'
        f'http = {{ host = "127.0.0.1", port = {http_port} }}\n'
        f'[model]\ndir = "{model_dir}"\n'
        f"[inference.engine]\nmax_model_len = {max_len}\n"
        # bf16 on both sides, as deployed (the engine's "auto" is float32 on a CPU
        # without native bf16 GEMMs, which would make this a precision benchmark).
        'dtype = "bfloat16"\nmax_num_seqs = 16\ncpu_kv_cache_gib = 0.25\n'
        "capture_routed_experts = true\n"
    )


def _wait_ready(target: str, process: ManagedProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.returncode() is not None:
                raise RuntimeError(
                    f"the inference service exited: {process.log_path.read_text()[-3000:]}"
                )
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"the inference service was not ready after {timeout_s:.0f} s")


async def _generate(
    target: str, token: str, prompts: list[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    async with make_channel(target, token=token, default_timeout_s=300) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)

        async def one(index: int, prompt: list[int]) -> dict[str, Any]:
            request = inference_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=inference_pb2.SamplingParams(
                    temperature=1.0, max_tokens=max_tokens, seed=index, ignore_eos=True
                ),
                return_routed_experts=True,
            )
            chunks = [chunk async for chunk in stub.Generate(request)]
            routed = [c.routed_experts for c in chunks if c.routed_experts.data]
            if not routed:
                raise RuntimeError("the inference service returned no routed experts")
            tokens = [t for c in chunks for t in c.token_ids]
            routes = routed_experts.decode(routed[-1], len(prompt) + len(tokens))
            assert routes is not None  # it has data
            return {
                "prompt": prompt,
                "tokens": tokens,
                "logprobs": [lp for c in chunks for lp in c.logprobs],
                "routes": torch.from_numpy(routes),
            }

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def collect(quick: bool, workdir: Path, model_dir: Path) -> list[dict[str, Any]]:
    """Serves ``model_dir`` and samples code prompts' completions with their routes."""
    from tokenizers import Tokenizer

    from services.model_factory.corpus import documents

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    num_prompts, max_tokens = (8, 24) if quick else (32, 48)
    prompts = [
        tokenizer.encode(document).ids[:24]
        for document, _ in zip(documents(1), range(num_prompts), strict=False)
    ]
    grpc_port, http_port = free_ports(2)
    config = workdir / "config.toml"
    _config(config, model_dir, grpc_port, http_port, 256)
    token = secrets.token_hex(16)
    process = ManagedProcess(
        "inference",
        [sys.executable, "-m", "services.inference", "--config", str(config)],
        workdir / "inference.log",
        env={"ETUDE_AUTH__TOKEN": token, "PYTHONUNBUFFERED": "1"},
    )
    process.start()
    try:
        target = f"127.0.0.1:{grpc_port}"
        _wait_ready(target, process, 600)
        samples = asyncio.run(_generate(target, token, prompts, max_tokens))
    finally:
        process.stop(30)
    return samples


def measure(
    model_dir: Path, samples: list[dict[str, Any]], orders: Sequence[Numerics] = ("eager",)
) -> dict[str, dict[str, float]]:
    """The trainer's bf16 logprobs of the sampled tokens, with and without replay, in each
    rounding order of ``orders``: their figures by order. The float32 reference forward,
    which every order's noise floor is measured against, runs once."""
    from services.trainer.model import Architecture, PackedInputs, load_pretrained, token_logprobs

    arch = Architecture.from_model_dir(model_dir)
    sequences = [s["prompt"] + s["tokens"] for s in samples]
    for sample, sequence in zip(samples, sequences, strict=True):
        if sample["routes"].shape != (len(sequence) - 1, arch.num_layers, arch.top_k):
            raise RuntimeError(
                f"routed experts of shape {tuple(sample['routes'].shape)} for "
                f"{len(sequence) - 1} input tokens"
            )
    free = PackedInputs.pack([s[:-1] for s in sequences])
    replayed = PackedInputs.pack(
        [s[:-1] for s in sequences],
        [s["routes"] for s in samples],
        num_layers=arch.num_layers,
        top_k=arch.top_k,
    )
    rows = torch.cat(
        [
            torch.arange(start + len(s["prompt"]) - 1, end)
            for s, start, end in zip(samples, free.cu_seqlens, free.cu_seqlens[1:], strict=False)
        ]
    )
    targets = torch.tensor([t for s in samples for t in s["tokens"]])
    reference = torch.tensor([lp for s in samples for lp in s["logprobs"]])
    inference_routes = torch.cat([s["routes"] for s in samples]).sort(-1).values
    exact = load_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        exact_logprobs, _ = token_logprobs(exact, exact(replayed).hidden[rows], targets)
    figures: dict[str, dict[str, float]] = {}
    for numerics in orders:
        model = load_pretrained(model_dir, dtype=torch.bfloat16, numerics=numerics)
        with torch.no_grad():
            own = model(free)
            own_logprobs, _ = token_logprobs(model, own.hidden[rows], targets)
            with_replay = model(replayed)
            replay_logprobs, _ = token_logprobs(model, with_replay.hidden[rows], targets)
        agreement = (own.experts.sort(-1).values == inference_routes).all(-1).float().mean()
        choices = with_replay.num_replayed * arch.num_layers * arch.top_k
        without, with_ = (own_logprobs - reference).abs(), (replay_logprobs - reference).abs()
        figures[numerics] = {
            "mismatch_without_replay": float(without.mean()),
            "mismatch_with_replay": float(with_.mean()),
            **tail_figures(without, "without_replay"),
            **tail_figures(with_, "with_replay"),
            "replacement_rate": sum(with_replay.num_replaced) / max(choices, 1),
            "route_agreement_without_replay": float(agreement),
            "bf16_noise_floor": float((replay_logprobs - exact_logprobs).abs().mean()),
            "mismatch_fp32_with_replay": float((exact_logprobs - reference).abs().mean()),
            "generated_tokens": float(targets.numel()),
        }
    return figures


def tail_figures(gap: torch.Tensor, suffix: str) -> dict[str, float]:
    """The tail of ``gap`` (|Δlogp| per generated token): its 99th percentile, maximum and
    the fraction of extreme tokens, each name ending in ``suffix``."""
    return {
        f"mismatch_p99_{suffix}": float(gap.quantile(0.99)),
        f"mismatch_max_{suffix}": float(gap.max()),
        f"extreme_fraction_{suffix}": float((gap > math.log(EXTREME_TAU)).float().mean()),
    }


def _with_ratio(figures: dict[str, float]) -> dict[str, float]:
    ratio = figures["mismatch_without_replay"] / max(figures["mismatch_with_replay"], 1e-12)
    return {**figures, "mismatch_ratio": ratio}


def result(
    figures: dict[str, float],
    quick: bool,
    fused: dict[str, float] | None = None,
    model: str = FACTORY_TINY,
    multiturn: dict[str, float] | None = None,
) -> BenchResult:
    """The answer for ``figures`` (eager numerics) and ``fused``'s, suffixed ``_fused``,
    measured on ``model``, with the multi-turn workload's ``multiturn`` figures."""
    figures = _with_ratio(figures)
    ratio = figures["mismatch_ratio"]
    ok = ratio >= TARGET_RATIO
    target = f"mismatch_ratio >= {TARGET_RATIO:g} (tiny model, bf16)"
    if multiturn is not None:
        figures |= multiturn
        ok = ok and multiturn["multiturn_ratio"] >= ratio
        target += "; multiturn_ratio >= mismatch_ratio"
    if fused is not None:
        figures |= {
            f"{name}_fused": value
            for name, value in _with_ratio(fused).items()
            if name not in ("generated_tokens", "mismatch_fp32_with_replay")
        }
    return BenchResult(
        figures=figures,
        baseline={"mismatch_without_replay": figures["mismatch_without_replay"]},
        ok=ok,
        target=target,
        details={
            "model": model,
            "mode": "quick" if quick else "full",
            "numerics": "eager; figures suffixed _fused: fused",
        },
    )


def run(quick: bool) -> BenchResult:
    """Measures replay's effect on the tiny model; ok when the ratio meets the target."""
    with tempfile.TemporaryDirectory(prefix="etude-bench-replay-") as tmp:
        model_dir, model = served_model(quick, Path(tmp))
        try:
            samples = collect(quick, Path(tmp), model_dir)
        except (RuntimeError, grpc.RpcError) as error:
            detail = error.details() if isinstance(error, grpc.RpcError) else str(error)
            return BenchResult(
                figures={},
                baseline={},
                ok=False,
                target=f"mismatch_ratio >= {TARGET_RATIO:g}",
                details={"blocked": f"no routed experts from inference: {detail}"},
            )
        figures = measure(model_dir, samples, ("eager", "fused"))
        model_dirs, rollouts = replay_turns.collect(model_dir, Path(tmp), quick)
        multiturn = replay_turns.measure(model_dirs, rollouts)
        return result(figures["eager"], quick, figures["fused"], model, multiturn)
