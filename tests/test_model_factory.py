"""`etude model init`: tokenizer, checkpoint, determinism, loading in transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from services.model_factory.build import init_model, read_model_card
from services.model_factory.corpus import corpus, snippet
from services.model_factory.presets import PRESETS
from services.model_factory.vocabulary import SPECIAL_TOKENS, special_token_ids


def _digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def test_tiny_model_has_the_harness_tokens_and_loads(tiny_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    card = read_model_card(tiny_model)
    assert card["preset"] == "tiny" and card["parameters"]["total"] < 2_000_000
    assert card["parameters"]["active"] < card["parameters"]["total"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for token, token_id in special_token_ids().items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token) == [token_id]  # never split
    text = 'def f(x):\n    return x + 1\n<|tool_call|>{"name": "run"}<|/tool_call|>'
    assert tokenizer.decode(tokenizer.encode(text)) == text
    config = AutoConfig.from_pretrained(tiny_model)
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert len(tokenizer) <= config.vocab_size == PRESETS["tiny"].vocab_size


def test_same_seed_same_files(tmp_path: Path, tiny_model: Path) -> None:
    again = init_model("tiny", tmp_path / "again", seed=0)
    assert again == read_model_card(tiny_model)
    assert _digest(tmp_path / "again") == _digest(tiny_model)
    other = init_model("tiny", tmp_path / "other", seed=1)
    assert (
        _digest(tmp_path / "other")["model.safetensors"] != _digest(tiny_model)["model.safetensors"]
    )
    assert other["seed"] == 1


def test_small_preset_is_in_the_demo_range(tmp_path: Path) -> None:
    card = init_model("small", tmp_path / "small", seed=0)
    assert 10_000_000 <= card["parameters"]["total"] <= 30_000_000
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]


def test_a_shape_of_ones_own_is_written_with_its_architecture(tmp_path: Path) -> None:
    from transformers import AutoConfig

    shape = PRESETS["tiny"].model_copy(update={"num_layers": 3, "num_experts": 16})
    card = init_model(shape, tmp_path / "m", seed=0)
    assert card["preset"] == "custom" and card["architecture"] == shape.model_dump()
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert (config.num_hidden_layers, config.num_experts) == (3, 16)


def test_existing_directory_is_not_overwritten_by_default(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(FileExistsError):
        init_model("tiny", tmp_path / "m")
    with pytest.raises(ValueError, match="unknown preset"):
        init_model("huge", tmp_path / "x")  # type: ignore[arg-type]


def test_transformers_forward_runs(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, PRESETS["tiny"].vocab_size)
    assert torch.isfinite(logits).all()


def test_corpus_is_deterministic_and_runs() -> None:
    assert corpus(3, 20_000) == corpus(3, 20_000)
    assert corpus(3, 20_000) != corpus(4, 20_000)
    import random

    rng = random.Random(0)
    for _ in range(200):  # every generated snippet's claimed value is what the code returns
        s = snippet(rng)
        namespace: dict[str, object] = {}
        exec(s.source, namespace)
        assert repr(eval(s.call, namespace)) == s.expected, s.source


def test_special_tokens_come_first_in_order() -> None:
    assert list(special_token_ids().values()) == list(range(len(SPECIAL_TOKENS)))
