"""The multi-turn workload of `etude bench replay`: replay over rollouts that span turns
and a weight update.

Concurrent rollouts of ``NUM_TURNS`` turns, as the harness runs them: each turn's prompt
is the context so far, closed and followed by a tool output (``<|tool|><|tool_result|>``
text of a code file ``<|/tool_result|><|end_of_turn|><|assistant|>``); every call asks
inference for the routes from where the rollout's table ends, and the harness's
``SegmentBuilder`` stitches them. After the first turn the engine loads the next version
(the model with a small perturbation, ``UPDATE_SCALE`` of each tensor's spread: the size
of an RL step, not a different model); the rollouts keep their first version's prefix
cache, so later turns attend to the KV their earlier turns wrote.

The trainer's model then scores every generated token under the version that sampled it
(version 0's weights for turn 1, version 1's for the later turns), with its own router,
replaying the stitched (sampling-time) routes, and replaying the table of a last call that
re-prefills the whole context under the newer version (what keeping only the last
call's table, with prefix caching off, replayed before):

* ``multiturn_mismatch_without_replay``, ``multiturn_mismatch_with_replay``,
  ``multiturn_ratio`` = without / with, beside the single-turn ``mismatch_ratio``
  (target: ``multiturn_ratio`` >= ``mismatch_ratio``);
* ``multiturn_mismatch_with_last_call_replay`` and ``multiturn_ratio_last_call``;
* ``multiturn_routing_bytes_per_rollout`` and ``..._whole_context_ratio`` (the bytes had
  every call returned its whole context's table / the bytes sent).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services import routed_experts
from services.envs.harness import Generation, SegmentBuilder

NUM_TURNS = 3
UPDATE_SCALE = 0.005


def updated_model(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """``model_dir``'s checkpoint with every tensor moved by ``UPDATE_SCALE`` of its spread
    (seeded noise), written to ``out``: a policy one small step away."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        noise = torch.randn(tensor.shape, generator=generator) * UPDATE_SCALE
        spread = tensor.float().std().clamp(min=1e-3) if tensor.numel() > 1 else 1e-3
        tensors[name] = (tensor.float() + noise * spread).to(tensor.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _sampling(max_tokens: int, seed: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=seed,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


async def _call(
    engine: Any,
    prompt: list[int],
    max_tokens: int,
    seed: int,
    routes_from: int,
    cache_version: int | None,
) -> tuple[Generation, int]:
    """One Generate on the engine as the harness sees it; and its whole-context row count."""
    chunks = [
        chunk
        async for chunk in engine.generate(
            prompt,
            _sampling(max_tokens, seed),
            return_routed_experts=True,
            routed_experts_from=routes_from,
            prefix_cache_version=cache_version,
        )
    ]
    last = chunks[-1]
    assert last.routed_experts is not None
    generation = Generation(
        token_ids=[t for c in chunks for t in c.token_ids],
        logprobs=[lp for c in chunks for lp in c.logprobs],
        version_spans=last.version_spans,
        routing=routed_experts.encode(last.routed_experts),
        finish_reason=last.finish_reason or "",
        routing_start=routes_from,
        num_cached_tokens=last.num_cached_tokens,
    )
    return generation, len(prompt) + len(generation.token_ids) - 1


async def _rollouts(
    model_dir: Path,
    new_weights: dict[str, torch.Tensor],
    prompts: list[list[int]],
    tool_outputs: list[list[int]],
    turn_tokens: int,
) -> tuple[int, list[dict[str, Any]]]:
    from services.config.inference import EngineConfig
    from services.inference.engine import Engine
    from services.model_factory.vocabulary import special_token_ids

    special = special_token_ids()
    opening = [special["<|end_of_turn|>"], special["<|tool|>"], special["<|tool_result|>"]]
    closing = [special["<|/tool_result|>"], special["<|end_of_turn|>"], special["<|assistant|>"]]
    engine = Engine(
        EngineConfig(
            model_dir=model_dir,
            dtype="bfloat16",
            max_model_len=1024,
            max_num_seqs=16,
            cpu_kv_cache_gib=0.25,
            block_size=32,
        )
    )
    await engine.start()
    base_version = engine.serving_version
    try:
        segments = [SegmentBuilder(list(p), len(p)) for p in prompts]
        whole_rows = [0] * len(prompts)
        for turn in range(NUM_TURNS):
            if turn == 1:  # an update mid-rollout: between turns 1 and 2
                await engine.apply_weights(new_weights, base_version + 1)
            if turn:
                for segment, output in zip(segments, tool_outputs, strict=True):
                    segment.add_injected(opening + output + closing)
            calls = await asyncio.gather(
                *(
                    _call(
                        engine, s.token_ids, turn_tokens, 100 * i + turn, s.num_routed, base_version
                    )
                    for i, s in enumerate(segments)
                )
            )
            for index, (segment, (generation, rows)) in enumerate(
                zip(segments, calls, strict=True)
            ):
                segment.add_generated(generation)
                whole_rows[index] += rows
        # What keeping the last call's table replayed before: with no prefix cache, the
        # last call re-prefilled the whole context under the version serving then.
        last_calls = await asyncio.gather(
            *(_call(engine, s.token_ids, 1, 7, 0, None) for s in segments)
        )
    finally:
        await engine.stop()
    rollouts = []
    for index, segment in enumerate(segments):
        record = segment.to_proto()
        tokens = list(record.token_ids)
        versions = np.full(len(tokens), -1)
        for span in record.version_spans:
            start = record.num_prompt_tokens
            versions[start + span.start : start + span.end] = span.version
        table = routed_experts.decode(record.routed_experts, len(tokens))
        last = routed_experts.decode(last_calls[index][0].routing, len(tokens) + 1)  # type: ignore[arg-type]
        assert table is not None and last is not None
        rollouts.append(
            {
                "tokens": tokens,
                "logprobs": [0.0] * record.num_prompt_tokens + list(record.logprobs),
                "versions": versions,
                "routes": torch.from_numpy(table),
                "last_call_routes": torch.from_numpy(last[: len(tokens) - 1]),
                "routing_bytes": segment.routing_bytes,
                "whole_context_bytes": whole_rows[index]
                * (segment.routing_bytes / max(segment.num_routed, 1)),
            }
        )
    return base_version, rollouts


def collect(
    model_dir: Path, workdir: Path, quick: bool
) -> tuple[dict[int, Path], list[dict[str, Any]]]:
    """Runs the multi-turn rollouts on an engine serving ``model_dir``; returns each
    version's model directory and the rollouts."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from services.model_factory.corpus import documents

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    num_rollouts, turn_tokens = (4, 16) if quick else (16, 32)
    texts = [d for d, _ in zip(documents(2), range(2 * num_rollouts), strict=False)]
    prompts = [tokenizer.encode(t).ids[:24] for t in texts[:num_rollouts]]
    tool_outputs = [tokenizer.encode(t).ids[:16] for t in texts[num_rollouts:]]
    new_dir = updated_model(model_dir, workdir / "updated")
    new_weights = load_file(str(new_dir / "model.safetensors"))
    base, rollouts = asyncio.run(
        _rollouts(model_dir, new_weights, prompts, tool_outputs, turn_tokens)
    )
    return {base: model_dir, base + 1: new_dir}, rollouts


def measure(model_dirs: dict[int, Path], rollouts: list[dict[str, Any]]) -> dict[str, float]:
    """Mismatch of the trainer's bf16 logprobs against vLLM's on every generated token,
    each scored by the weights of the version that sampled it."""
    from services.bench.replay import tail_figures
    from services.trainer.model import Architecture, PackedInputs, load_pretrained, token_logprobs

    arch = Architecture.from_model_dir(model_dirs[min(model_dirs)])
    inputs = [r["tokens"][:-1] for r in rollouts]
    shape = {"num_layers": arch.num_layers, "top_k": arch.top_k}
    free = PackedInputs.pack(inputs)
    replayed = PackedInputs.pack(inputs, [r["routes"] for r in rollouts], **shape)
    last_call = PackedInputs.pack(inputs, [r["last_call_routes"] for r in rollouts], **shape)
    gaps: dict[str, list[torch.Tensor]] = {"without": [], "with": [], "last_call": []}
    for version, model_dir in sorted(model_dirs.items()):
        rows, targets, reference = [], [], []
        for rollout, start in zip(rollouts, free.cu_seqlens, strict=False):
            for position in np.flatnonzero(rollout["versions"] == version):
                rows.append(int(start) + int(position) - 1)  # target q: input row q - 1
                targets.append(rollout["tokens"][position])
                reference.append(rollout["logprobs"][position])
        if not rows:
            continue
        index, target = torch.tensor(rows), torch.tensor(targets)
        behaviour = torch.tensor(reference)
        model = load_pretrained(model_dir, dtype=torch.bfloat16)
        with torch.no_grad():
            for name, packed in (("without", free), ("with", replayed), ("last_call", last_call)):
                logprobs, _ = token_logprobs(model, model(packed).hidden[index], target)
                gaps[name].append((logprobs - behaviour).abs())
    without, with_, last = (torch.cat(gaps[k]) for k in ("without", "with", "last_call"))
    sent = sum(r["routing_bytes"] for r in rollouts)
    return {
        "multiturn_mismatch_without_replay": float(without.mean()),
        "multiturn_mismatch_with_replay": float(with_.mean()),
        "multiturn_mismatch_with_last_call_replay": float(last.mean()),
        "multiturn_ratio": float(without.mean() / with_.mean().clamp(min=1e-12)),
        "multiturn_ratio_last_call": float(without.mean() / last.mean().clamp(min=1e-12)),
        **{f"multiturn_{k}": v for k, v in tail_figures(without, "without_replay").items()},
        **{f"multiturn_{k}": v for k, v in tail_figures(with_, "with_replay").items()},
        "multiturn_generated_tokens": float(without.numel()),
        "multiturn_routing_bytes_per_rollout": sent / len(rollouts),
        "multiturn_routing_bytes_whole_context_ratio": sum(
            r["whole_context_bytes"] for r in rollouts
        )
        / max(sent, 1),
    }
