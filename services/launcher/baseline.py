"""The starting point of RL, published and scored before the trainer moves it.

The base model (CPT + SFT) is policy version 0 of the run: inference serves it from
disk at start-up, but evals score only published versions. ``publish_initial`` publishes
the model directory's weights as version 0 (a keyframe, through the same publisher the
trainer uses) and announces it to the reconciler; ``etude run`` then waits for the evals
of version 0 before it starts the trainer, so "SFT pass@1" is measured on exactly those
weights and not on a mix with the first RL versions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.config.deployment import EtudeConfig
from services.objectstore.base import ObjectStore
from services.weights.manifest import Layout, read_latest

if TYPE_CHECKING:
    import torch


def load_model_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The HF-layout tensors of every safetensors file in ``model_dir``."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors


def publish_initial(config: EtudeConfig, store: ObjectStore, model_dir: Path) -> bool:
    """Publishes ``model_dir`` as version 0 unless a version is already published.

    Returns True when it published. Nothing is announced: version 0 is every run's
    starting version (the reconciler's, and what inference loads from disk), and the
    evals service finds the manifest in the store.
    """
    from services.weights.publisher import WeightPublisher

    layout = Layout(config.run.name)
    if read_latest(store, layout) is not None:
        return False
    publisher = WeightPublisher(store, config.run.name, config.weights)
    try:
        tensors = load_model_tensors(model_dir)
        publisher.publish(tensors, 0, keyframe=True).result()
    finally:
        publisher.close()
    return True
