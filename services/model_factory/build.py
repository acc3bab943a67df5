"""Builds a model directory: tokenizer, Qwen3-MoE config, random weights, model card.

The directory is the HF layout (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) plus ``etude_model.json``, which
records the preset, the seed and the special-token ids.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import services
from services.model_factory.corpus import corpus
from services.model_factory.presets import PRESETS, ModelPreset, PresetName
from services.model_factory.vocabulary import (
    END_OF_TEXT,
    END_OF_TURN,
    PAD,
    SPECIAL_TOKENS,
    special_token_ids,
)

MODEL_CARD = "etude_model.json"

Progress = Callable[[str], None]


def train_tokenizer(preset: ModelPreset, seed: int) -> Any:
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained on the generated corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed, preset.corpus_bytes), trainer)
    ids = special_token_ids()
    for token, expected in ids.items():
        assert tokenizer.token_to_id(token) == expected, f"{token} did not get id {expected}"
    return tokenizer


def _save_tokenizer(tokenizer: Any, preset: ModelPreset, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (END_OF_TEXT, PAD)],
        model_max_length=preset.max_position_embeddings,
    )
    fast.save_pretrained(out)


def _quiet_cuda_only_extensions() -> None:
    """On a CPU build of torch, torchao (which transformers imports for its quantizers)
    warns that its CUDA kernels fail to load, and torch warns about torchao's enums: at
    the top of every first `make run`, looking like a broken install. Neither can matter
    without CUDA; on a CUDA build both keep their say."""
    import torch

    if torch.version.cuda is None:
        logging.getLogger("torchao").setLevel(logging.ERROR)
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def _save_weights(preset: ModelPreset, seed: int, out: Path) -> dict[str, int]:
    import torch

    _quiet_cuda_only_extensions()
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    ids = special_token_ids()
    config = Qwen3MoeConfig(**preset.hf_config(ids), dtype="bfloat16")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=[ids[END_OF_TEXT], ids[END_OF_TURN]], pad_token_id=ids[PAD]
    ).save_pretrained(out)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * preset.num_experts_per_token // preset.num_experts
    return {"total": total, "active": active}


def init_model(
    preset: PresetName | ModelPreset,
    out: Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Writes a new model of `preset` to `out` and returns its model card.

    `preset` names one of ``PRESETS`` or is a shape of its own (its card says
    ``"preset": "custom"``). The directory appears complete or not at all: everything is
    written to a temporary sibling and renamed into place.
    """
    if isinstance(preset, ModelPreset):
        shape, name = preset, "custom"
    elif preset in PRESETS:
        shape, name = PRESETS[preset], preset
    else:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    say = progress or (lambda _message: None)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as staging_dir:
        staging = Path(staging_dir)
        say(f"training a {shape.vocab_size}-token BPE tokenizer on the code corpus")
        tokenizer = train_tokenizer(shape, seed)
        _save_tokenizer(tokenizer, shape, staging)
        say("initialising Qwen3-MoE weights")
        parameters = _save_weights(shape, seed, staging)
        card = {
            "preset": name,
            "seed": seed,
            "parameters": parameters,
            "special_tokens": special_token_ids(),
            "tokenizer_size": tokenizer.get_vocab_size(),
            "architecture": shape.model_dump(),
            "etude_version": services.__version__,
            "policy_version": 0,
        }
        (staging / MODEL_CARD).write_text(json.dumps(card, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.chmod(0o755)  # mkdtemp makes it private
        staging.rename(out)
    say(f"wrote {out} in {time.perf_counter() - started:.1f} s")
    return card


def read_model_card(model_dir: Path) -> dict[str, Any]:
    """The model card of a factory-made model directory."""
    path = model_dir / MODEL_CARD
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no {MODEL_CARD}: not made by `etude model init`")
    card: dict[str, Any] = json.loads(path.read_text())
    return card
