"""The MTP head as a vLLM speculative-decoding draft (services/inference/mtp_draft.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.config.inference import EngineConfig
from services.draft_layout import DRAFT_PREFIX, published_draft, split_draft
from services.inference.mtp_draft import (
    ACCEPTED,
    ARCHITECTURE,
    DRAFTED,
    DRAFTS,
    draft_tensors,
    export_draft,
    speculation_counts,
)
from services.trainer.model.architecture import Architecture
from services.trainer.model.mtp import MTPHead

if TYPE_CHECKING:
    from services.inference.engine import Engine


def head_file(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """One fresh MTP head for `model_dir`'s shape, saved as the trainer names it."""
    head = MTPHead(Architecture.from_model_dir(model_dir))
    head.reset_parameters(torch.Generator().manual_seed(seed))
    tensors = {f"mtp.0.{n}": p.detach().contiguous() for n, p in head.named_parameters()}
    save_file(tensors, str(out))
    return out


def draft_engine(
    model_dir: Path, draft_dir: Path | None, *, capture: bool = False, max_num_seqs: int = 1
) -> Engine:
    """An engine on `model_dir` that speculates 2 tokens a step with `draft_dir` (if any)."""
    from services.inference.engine import Engine

    return Engine(
        EngineConfig(
            model_dir=model_dir,
            max_num_seqs=max_num_seqs,
            max_model_len=256,
            cpu_kv_cache_gib=0.25,
            capture_routed_experts=capture,
            draft_dir=draft_dir,
            speculative_tokens=2 if draft_dir else 0,
        )
    )


def greedy(max_tokens: int) -> Any:
    """Greedy sampling with delta outputs (what Engine.generate takes)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, output_kind=RequestOutputKind.DELTA
    )


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


def test_a_heads_tensors_map_one_by_one_as_the_whole_head_does(
    tiny_model: Path, tmp_path: Path
) -> None:
    """What a sharded job publishes tensor by tensor is the draft the whole head makes;
    deeper heads publish nothing; a version splits back into model and draft."""
    heads = load_file(str(head_file(tiny_model, tmp_path / "mtp.safetensors")))
    deeper = {n.replace("mtp.0.", "mtp.1."): t for n, t in heads.items()}
    published: dict[str, torch.Tensor] = {}
    for name, tensor in {**heads, **deeper}.items():
        published |= published_draft(name, tensor)
    whole = draft_tensors(heads)
    assert published.keys() == {DRAFT_PREFIX + name for name in whole}
    for name, tensor in whole.items():
        assert torch.equal(published[DRAFT_PREFIX + name], tensor), name
    served = {"model.norm.weight": torch.ones(2), **published}
    model, draft = split_draft(served)
    assert list(model) == ["model.norm.weight"] and draft.keys() == whole.keys()


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
    EngineConfig(draft_dir=tmp_path, speculative_tokens=2, capture_routed_experts=False)
    EngineConfig(draft_dir=tmp_path, speculative_tokens=2)  # capture too, on CPU


def test_capture_under_speculation_keeps_the_routes_of_the_tokens_that_stayed(
    tiny_model: Path, tmp_path: Path
) -> None:
    """With a draft that is often right and often wrong (the copy head), routed-expert
    capture returns one row per position run, each the route of the token that stayed:
    the rows of draft tokens the policy rejected are written again when their position
    runs with the sampled token, and those of the last verification are cut at the
    request's end. Against the same engine without a draft: the same tokens, the same
    number of rows, and the same routes but where a route is a near tie that the
    verification's batch shape rounds differently (measured: none)."""
    copy_file = tmp_path / "copy.safetensors"
    save_file(copy_head(tiny_model), str(copy_file))
    draft = export_draft(tiny_model, tmp_path / "copy", mtp_file=copy_file)
    prompts = [[7] * 24, list(range(40, 72)), [3, 9] * 12, [11, 12, 13] * 8]
    sampling = greedy(48)

    async def serve(draft_dir: Path | None) -> tuple[list[list[int]], list[np.ndarray], float]:
        engine = draft_engine(tiny_model, draft_dir, capture=True)
        await engine.start()
        try:
            before = speculation_counts()
            outputs, routes = [], []
            for index, prompt in enumerate(prompts):
                chunks = [
                    chunk
                    async for chunk in engine.generate(
                        prompt, sampling, return_routed_experts=True, routed_experts_from=index
                    )
                ]
                outputs.append([t for c in chunks for t in c.token_ids])
                table = chunks[-1].routed_experts
                assert table is not None and chunks[-1].routed_experts_start == index
                routes.append(table)
            after = speculation_counts()
            rejected = (after[DRAFTED] - before[DRAFTED]) - (after[ACCEPTED] - before[ACCEPTED])
            return outputs, routes, rejected
        finally:
            await engine.stop()

    plain_outputs, plain_routes, _ = asyncio.run(serve(None))
    outputs, routes, rejected = asyncio.run(serve(draft))
    assert outputs == plain_outputs
    assert rejected > 0, "the draft was never wrong: nothing was tested"
    for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        assert routes[index].shape == plain_routes[index].shape
        assert routes[index].shape[0] == len(prompt) + len(output) - 1 - index
    rows = np.concatenate(routes)
    plain = np.concatenate(plain_routes)
    same = (np.sort(rows, axis=-1) == np.sort(plain, axis=-1)).all(axis=(1, 2))
    assert same.mean() >= 0.98, f"{same.mean():.3f} of rows equal"


@pytest.mark.slow
def test_the_draft_speculates_and_changes_nothing_sampled(tiny_model: Path, tmp_path: Path) -> None:
    """vLLM loads the draft through the package's plugin, drafts with it, and greedy
    outputs equal the engine's without a draft (the policy verifies every token)."""
    draft = export_draft(
        tiny_model, tmp_path / "draft", mtp_file=head_file(tiny_model, tmp_path / "mtp.safetensors")
    )
    prompts = [list(range(40 + i, 72 + i)) for i in range(3)]
    sampling = greedy(24)

    async def serve(draft_dir: Path | None) -> tuple[list[list[int]], dict[str, float]]:
        engine = draft_engine(tiny_model, draft_dir, max_num_seqs=4)
        await engine.start()
        try:
            before = speculation_counts()
            outputs = []
            for prompt in prompts:
                chunks = [chunk async for chunk in engine.generate(prompt, sampling)]
                outputs.append([t for c in chunks for t in c.token_ids])
            after = speculation_counts()
            return outputs, {k: after[k] - before.get(k, 0.0) for k in after}
        finally:
            await engine.stop()

    plain, _ = asyncio.run(serve(None))
    speculated, counts = asyncio.run(serve(draft))
    assert speculated == plain
    assert counts[DRAFTS] > 0 and counts[DRAFTED] == 2 * counts[DRAFTS]


def copy_head(model_dir: Path) -> dict[str, torch.Tensor]:
    """A head that proposes the token just sampled once more: the target's own greedy
    choice at the position before (``proj`` passes the normed hidden state through, the
    attention and MLP add nothing, and the LM head's argmax of a positive multiple of the
    target's last hidden state is the target's). It is accepted exactly where the target
    repeats a token, which a random model's greedy output does often."""
    arch = Architecture.from_model_dir(model_dir)
    head = MTPHead(arch)
    head.reset_parameters(torch.Generator().manual_seed(0))
    width = arch.hidden_size
    with torch.no_grad():
        head.hidden_norm.weight.fill_(1.0)
        head.final_norm.weight.fill_(1.0)
        head.proj.weight.zero_()
        head.proj.weight[:, :width] = torch.eye(width)
        head.attn.o_proj.weight.zero_()
        head.down.weight.zero_()
    return {f"mtp.0.{n}": p.detach().clone() for n, p in head.named_parameters()}


def test_a_version_brings_its_draft_into_the_running_engine(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A published version's MTP draft (under ``DRAFT_PREFIX``) replaces the running
    engine's draft in flight: after the update the engine accepts exactly the tokens an
    engine started with that draft accepts, and not those its first draft did. An engine
    that does not speculate takes the same version and leaves the draft out."""
    from services.trainer.model import load_pretrained, to_hf

    random_file = head_file(tiny_model, tmp_path / "random.safetensors")
    copy_file = tmp_path / "copy.safetensors"
    save_file(copy_head(tiny_model), str(copy_file))
    random_draft = export_draft(tiny_model, tmp_path / "random", mtp_file=random_file)
    copy_draft = export_draft(tiny_model, tmp_path / "copy", mtp_file=copy_file)
    # Version 1: the same policy, the copy head as its draft (as the trainer publishes it).
    model = load_pretrained(tiny_model, dtype=torch.float32, num_mtp_heads=1, seed=0)
    model.mtp.load_state_dict(
        {n.removeprefix("mtp."): t for n, t in load_file(str(copy_file)).items()}
    )
    version = to_hf(model, draft=True)
    assert {n.removeprefix(DRAFT_PREFIX) for n in version if n.startswith(DRAFT_PREFIX)} == set(
        draft_tensors(load_file(str(copy_file)))
    )
    prompts = [[7] * 24, list(range(40, 72)), [3, 9] * 12, [11, 12, 13] * 8, [5] * 8]
    sampling = greedy(64)

    async def accepted(draft_dir: Path | None, update: bool) -> tuple[float, list[list[int]]]:
        engine = draft_engine(tiny_model, draft_dir)
        await engine.start()
        try:
            if update:
                await engine.apply_weights(version, 1)
            before = speculation_counts()
            outputs = []
            for prompt in prompts:
                chunks = [chunk async for chunk in engine.generate(prompt, sampling)]
                outputs.append([t for c in chunks for t in c.token_ids])
            return speculation_counts()[ACCEPTED] - before[ACCEPTED], outputs
        finally:
            await engine.stop()

    first, first_outputs = asyncio.run(accepted(random_draft, update=False))
    updated, updated_outputs = asyncio.run(accepted(random_draft, update=True))
    started, _ = asyncio.run(accepted(copy_draft, update=False))
    _, plain_outputs = asyncio.run(accepted(None, update=True))
    assert updated == started and updated != first, (first, updated, started)
    assert updated_outputs == first_outputs == plain_outputs


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


def test_the_speculation_benchmark_measures_on_a_named_model(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ETUDE_BENCH_SPEC_MODEL_DIR`` swaps the factory model and its token-id prompts for
    a named model and the harness's opening of held-out tasks; a wrong one is refused
    with the variable named."""
    from services.bench import BenchSettingError
    from services.bench.inference import SPEC_MODEL_VARIABLE, SPEC_PROMPTS, spec_model
    from services.model_factory.vocabulary import special_token_ids

    monkeypatch.delenv(SPEC_MODEL_VARIABLE, raising=False)
    assert spec_model(tmp_path) == (tmp_path, None)
    monkeypatch.setenv(SPEC_MODEL_VARIABLE, str(tiny_model))
    model_dir, prompts = spec_model(tmp_path)
    special = special_token_ids()
    assert model_dir == tiny_model and prompts is not None and len(prompts) == SPEC_PROMPTS
    assert all(p[0] == special["<|system|>"] and p[-1] == special["<|assistant|>"] for p in prompts)
    assert len({tuple(p) for p in prompts}) == SPEC_PROMPTS
    monkeypatch.setenv(SPEC_MODEL_VARIABLE, str(tmp_path / "nothing"))
    with pytest.raises(BenchSettingError, match=SPEC_MODEL_VARIABLE):
        spec_model(tmp_path)
