"""The trainer's Qwen3-MoE against transformers' on the same checkpoint, packing, HF I/O, MTP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services import dtypes
from services.trainer.model import (
    Architecture,
    PackedInputs,
    Qwen3MoE,
    load_pretrained,
    resolve_compute_dtype,
    resolve_experts_precision,
    save_pretrained,
    token_logprobs,
)
from tests.trainer_support import sharpen_model


@pytest.fixture(scope="module")
def sharp_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharpen_model(tiny_model, tmp_path_factory.mktemp("sharp") / "tiny-sharp")


def _sequences() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(16, 985, (n,), generator=generator).tolist() for n in (41, 64, 7)]


def _our_logprobs(model: Qwen3MoE, sequences: list[list[int]]) -> torch.Tensor:
    inputs = PackedInputs.pack([s[:-1] for s in sequences])
    targets = torch.tensor([t for s in sequences for t in s[1:]])
    with torch.no_grad():
        output = model(inputs)
        logprobs, _ = token_logprobs(model, output.hidden, targets)
    return logprobs


def _transformers_logprobs(
    model_dir: Path, dtype: torch.dtype, sequences: list[list[int]]
) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    out = []
    with torch.no_grad():
        for sequence in sequences:
            logits = model(torch.tensor([sequence])).logits[0, :-1].float()
            log_probs = torch.log_softmax(logits, dim=-1)
            out.append(log_probs.gather(1, torch.tensor(sequence[1:])[:, None])[:, 0])
    return torch.cat(out)


@pytest.mark.parametrize(
    ("dtype", "max_tolerance", "mean_tolerance"),
    [
        # fp32: the same math in a different order; the must-show bound is 1e-4.
        (torch.float32, 1e-4, 1e-5),
        # bf16: measured bit-identical (0.0) on this machine, since every op follows
        # transformers' dtypes and order; the documented tolerance is bf16 resolution.
        (torch.bfloat16, 2e-2, 2e-3),
    ],
)
def test_logprobs_match_transformers(
    sharp_model: Path, dtype: torch.dtype, max_tolerance: float, mean_tolerance: float
) -> None:
    sequences = _sequences()
    reference = _transformers_logprobs(sharp_model, dtype, sequences)
    ours = _our_logprobs(load_pretrained(sharp_model, dtype=dtype), sequences)
    # The weights are decisive: a uniform model would agree trivially.
    assert reference.std() > 1.0
    difference = (ours - reference).abs()
    assert difference.max().item() <= max_tolerance, difference.max()
    assert difference.mean().item() <= mean_tolerance, difference.mean()


def test_packed_sequences_do_not_see_each_other(sharp_model: Path) -> None:
    model = load_pretrained(sharp_model, dtype=torch.float32)
    sequences = _sequences()
    packed = _our_logprobs(model, sequences)
    alone = torch.cat([_our_logprobs(model, [s]) for s in sequences])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_save_pretrained_is_the_checkpoint_vllm_and_transformers_load(
    sharp_model: Path, tmp_path: Path
) -> None:
    model = load_pretrained(sharp_model, dtype=torch.float32)
    out = save_pretrained(model, tmp_path / "saved", source_dir=sharp_model, policy_version=7)
    original, saved = (
        load_file(sharp_model / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[name], original[name]) for name in original)  # bf16 round trip
    assert '"policy_version": 7' in (out / "etude_model.json").read_text()
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    sequences = _sequences()[:1]
    torch.testing.assert_close(
        _transformers_logprobs(out, torch.float32, sequences),
        _our_logprobs(load_pretrained(out, dtype=torch.float32), sequences),
        rtol=0,
        atol=1e-4,
    )


def test_unsupported_architectures_are_refused_by_name() -> None:
    base = {
        "model_type": "qwen3_moe",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "max_position_embeddings": 64,
    }
    assert Architecture.from_hf_config(base).num_experts == 4
    with pytest.raises(ValueError, match="mlp_only_layers"):
        Architecture.from_hf_config({**base, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Architecture.from_hf_config({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="model_type"):
        Architecture.from_hf_config({**base, "model_type": "llama"})


def test_mtp_heads_learn_by_self_distillation_and_leave_the_policy_alone(
    sharp_model: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = load_pretrained(sharp_model, dtype=torch.float32, num_mtp_heads=2)
    inputs = PackedInputs.pack(_sequences())
    optimizer = torch.optim.AdamW(model.mtp.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss, per_head = model.mtp_loss(inputs, model(inputs))
        assert len(per_head) == 2
        optimizer.zero_grad()
        loss.backward()
        trunk_grads = [p.grad for n, p in model.named_parameters() if not n.startswith("mtp.")]
        assert all(grad is None for grad in trunk_grads)
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    saved = save_pretrained(model, tmp_path / "with-mtp", source_dir=sharp_model)
    assert not any(name.startswith("mtp.") for name in load_file(saved / "model.safetensors"))
    reloaded = load_pretrained(saved, dtype=torch.float32, num_mtp_heads=2)
    assert torch.equal(reloaded.mtp[0].proj.weight, model.mtp[0].proj.weight)


def test_the_model_trains_with_the_reports_precision_recipe(tiny_model: Path) -> None:
    """NVFP4-variant forward / MXFP8 backward expert GEMMs inside the full model."""
    from services.config.trainer import JobConfig
    from services.trainer.learner import Learner
    from services.trainer.sft import Example, to_microbatch

    job = JobConfig.model_validate(
        {
            "phase": "cpt",
            "data": {"kind": "corpus"},
            "model": {"experts_precision": "nvfp4_fwd_mxfp8_bwd"},
            "optimizer": {"lr": 1e-2},
        }
    )
    learner = Learner.load(tiny_model, job)
    experts = learner.model.model.layers[0].mlp.experts
    assert experts.config.precision == "nvfp4_fwd_mxfp8_bwd"
    tokens = [t % 900 + 16 for t in range(0, 400, 7)]
    batch = [to_microbatch([Example(tokens, [True] * len(tokens))])]
    losses = [learner.sft_step(batch, step)["loss"] for step in range(3)]
    assert losses[2] < losses[0] - 0.3, losses


@pytest.mark.parametrize("native", [True, False])
def test_auto_compute_dtype_is_bf16_only_where_bf16_gemms_are_native(
    native: bool, monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    assert resolve_compute_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_compute_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_compute_dtype("float32", "cuda") == torch.float32
    assert resolve_compute_dtype("bfloat16", "cpu") == torch.bfloat16
    # A model given no recipe runs its experts in that of its compute dtype.
    model = load_pretrained(tiny_model, dtype=resolve_compute_dtype("auto", "cpu"))
    assert model.model.layers[0].mlp.experts.config.precision == ("bf16" if native else "fp32")


def test_auto_expert_precision_follows_the_compute_dtype() -> None:
    assert resolve_experts_precision("auto", torch.float32).precision == "fp32"
    assert resolve_experts_precision("auto", torch.bfloat16).precision == "bf16"
    chosen = resolve_experts_precision("nvfp4_fwd_mxfp8_bwd", torch.float32, "emulated")
    assert (chosen.precision, chosen.backend) == ("nvfp4_fwd_mxfp8_bwd", "emulated")


def test_packed_attention_and_its_gradients_equal_one_attention_per_sequence() -> None:
    """``causal_attention`` splits the stream (a slice per sequence made the backward zero-fill
    the whole stream once per sequence): outputs and gradients are those of attending within
    each sequence alone, a one-token sequence included."""
    from services.trainer.model.layers import causal_attention

    generator = torch.Generator().manual_seed(5)
    lengths = [7, 1, 12, 4]
    cu_seqlens = [0, 7, 8, 20, 24]
    query = torch.randn(24, 4, 8, generator=generator, requires_grad=True)
    key = torch.randn(24, 2, 8, generator=generator, requires_grad=True)
    value = torch.randn(24, 2, 8, generator=generator, requires_grad=True)
    grad = torch.randn(24, 4, 8, generator=generator)
    packed_out = causal_attention(query, key, value, cu_seqlens)
    packed_out.backward(grad)

    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        q, k, v = (t[rows].detach().clone().requires_grad_() for t in (query, key, value))
        # GQA by hand: each key/value head serves two query heads.
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) / 8**0.5
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", weights, v.repeat_interleave(2, dim=1))
        out.backward(grad[rows])
        torch.testing.assert_close(packed_out[rows].detach(), out.detach(), atol=1e-5, rtol=1e-5)
        for packed, alone in ((query, q), (key, k), (value, v)):
            assert packed.grad is not None and alone.grad is not None
            torch.testing.assert_close(packed.grad[rows], alone.grad, atol=1e-5, rtol=1e-5)
        start += length


@pytest.mark.parametrize("shared", [False, True])
def test_activation_checkpointing_gives_the_same_loss_and_gradients_bit_for_bit(
    sharp_model: Path, shared: bool
) -> None:
    """Each decoder layer recomputed in backward routes and computes exactly as the first
    pass: with router replay on half the tokens, and over a prefix tree."""
    arch = Architecture.from_model_dir(sharp_model)
    prompt = _sequences()[1][:20]
    sequences = [prompt + s[:30] for s in _sequences()]  # a shared prefix for the tree
    generator = torch.Generator().manual_seed(1)
    replay = []
    for sequence in sequences:
        shape = (len(sequence) - 1, arch.num_layers, arch.top_k)
        routes = torch.randint(0, arch.num_experts, shape, generator=generator)
        routes[::2] = -1  # every other token routes by the router
        replay.append(routes)
    inputs_list = [s[:-1] for s in sequences]
    targets = torch.tensor([t for s in sequences for t in s[1:]])
    if shared:
        trained = [[j >= len(prompt) - 1 for j in range(len(s))] for s in inputs_list]
        inputs, source = PackedInputs.pack_shared(
            inputs_list, trained, replay, num_layers=arch.num_layers, top_k=arch.top_k
        )
        assert len(source) < len(targets)  # the prompt is computed once
        targets = targets[source]
    else:
        inputs = PackedInputs.pack(
            inputs_list, replay, num_layers=arch.num_layers, top_k=arch.top_k
        )
    results = []
    for recompute in (False, True):
        model = load_pretrained(sharp_model, dtype=torch.float32)
        model.activation_checkpointing = recompute
        saved: list[int] = []

        def keep(tensor: torch.Tensor, sizes: list[int] = saved) -> torch.Tensor:
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            output = model(inputs)
        logprobs, _ = token_logprobs(model, output.hidden, targets)
        logprobs.sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logprobs.detach(), output.experts, grads, sum(saved)))
    (logprobs, experts, grads, kept), (logprobs_r, experts_r, grads_r, kept_r) = results
    assert kept_r < kept / 3  # the layers' activations were not kept for backward
    assert torch.equal(logprobs, logprobs_r) and torch.equal(experts, experts_r)
    assert len(grads) == len(grads_r) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r, strict=True))
