"""MTP heads fitted to a frozen model by self-distillation, outside a training job.

A trained policy carries heads when its job trains them (``model.num_mtp_heads``,
``mtp_loss_coef``); a model that never had any — a factory model, a base model — gets
them here: the trunk frozen, only the heads trained, on the model factory's corpus,
toward the main head's own distribution (``model.mtp.mtp_distillation_loss``). The
benchmark of speculative decoding drafts with heads made this way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def distill_heads(
    model_dir: Path,
    out_file: Path,
    *,
    steps: int,
    num_heads: int = 1,
    tokens_per_step: int = 4096,
    max_seq_len: int = 256,
    lr: float = 2e-3,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Fits `num_heads` fresh heads to `model_dir`'s frozen model for `steps` AdamW steps
    and writes them to `out_file` (an ``mtp.safetensors``); returns each step's loss."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from services.trainer.model import load_pretrained
    from services.trainer.sft import CorpusSource, ExampleStream, to_microbatch

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    model = load_pretrained(model_dir, dtype=torch.float32, num_mtp_heads=num_heads, seed=seed)
    model.requires_grad_(False)
    heads = list(model.mtp.parameters())
    for param in heads:
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(heads, lr=lr, weight_decay=0.0)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stream = ExampleStream(CorpusSource(tokenizer, max_seq_len, seed), tokens_per_step)
    losses: list[float] = []
    model.train()
    for step in range(steps):
        microbatch = to_microbatch(stream.next_batch())
        with torch.no_grad():
            output = model(microbatch.inputs)
        loss, _ = model.mtp_loss(microbatch.inputs, output)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    heads_state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if name.startswith("mtp.")
    }
    save_file(heads_state, str(out_file), metadata={"format": "pt"})
    return losses
